"""The agentic answer format of the commit rows (`<plan>…</plan>`, one or more `<read>chunk</read>`, `<edit>new
file</edit>`). Shared by the commits suite
(pipelines.evaluate.commits scores answers) and stage 3 (pipelines.teachers.improve verifies a teacher's trajectories),
so both read the format the same way.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from pipelines.format.tokenizer import EDIT, END_EDIT, END_PLAN, END_READ, EOS, PLAN, READ, SPECIAL_IDS, VOCAB_SIZE

AGENTIC = re.compile(r"\s*<plan>(?P<plan>.*?)</plan>\s*(?P<reads>(?:<read>.*?</read>\s*)+)<edit>.*?</edit>\s*", re.S)
READ_TAG = re.compile(r"<read>(.*?)</read>", re.S)
TAGS = {SPECIAL_IDS[t]: t for t in (PLAN, END_PLAN, READ, END_READ, EDIT, END_EDIT)}
SHAPE = re.compile(r"Pp(?:Rr)+Ee")  # the order of the tags: plan, reads, edit
LETTER = {PLAN: "P", END_PLAN: "p", READ: "R", END_READ: "r", EDIT: "E", END_EDIT: "e"}
TAG_OF = {letter: tag for tag, letter in LETTER.items()}


# ---------------------------------------------------------------------------------------------- answers as text
def edited_file(answer: str) -> str:
    """The new file an answer writes: what its last `<edit>` holds (to `</edit>` or the end), else the whole answer
    (the raw, hinted and imperative variants answer with the file itself)."""
    if EDIT not in answer:
        return answer
    return answer.rsplit(EDIT, 1)[1].split(END_EDIT, 1)[0]


def same_file(a: str, b: str) -> bool:
    return unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b)


def chunk_names(memory: list[str]) -> list[str]:
    """`### <path> [chunk <k>]` of each memory chunk (its first line)."""
    return [text.split("\n", 1)[0].strip() for text in memory]


def agentic_compliance(answer: str, real: list[str], path: str) -> bool:
    """plan -> read(s) -> edit, in order and nothing else; every read names a real chunk (`real`: the memory's
    chunks and what the reference reads, e.g. a new file's `### path [new file]`), one of them the edited file's."""
    match = AGENTIC.fullmatch(answer)
    if not match or not match.group("plan").strip():
        return False
    reads = [r.strip() for r in READ_TAG.findall(match.group("reads"))]
    return all(r in real for r in reads) and any(r.startswith(f"### {path} [") for r in reads)


# ---------------------------------------------------------------------------------------------- answers as ids
@dataclass(frozen=True)
class Trajectory:
    plan: str
    reads: list[str]
    edit: str


class FormatError(ValueError):
    """Generated ids that are not one plan -> reads -> edit trajectory; the message says what is wrong."""


def parse_trajectory(ids: list[int], tokenizer) -> Trajectory:
    """A generation (ids after the prompt, `<plan>` included) as a trajectory, read from its control tokens rather
    than from decoded text: a file whose text says `<edit>` cannot pass for a tag. Between tags only whitespace; the
    plan not empty; ends with `<|im_end|>` (a generation cut at its token limit does not)."""
    if SPECIAL_IDS[EOS] not in ids:
        raise FormatError("no <|im_end|>: cut at max_new_tokens")
    ids = ids[: ids.index(SPECIAL_IDS[EOS])]
    shape, texts, current = "", [], []
    for i in ids:
        if i in TAGS:
            texts.append(decode(tokenizer, current))
            shape, current = shape + LETTER[TAGS[i]], []
        else:
            current.append(i)
    texts.append(decode(tokenizer, current))
    if not SHAPE.fullmatch(shape):
        shown = "".join(TAG_OF[letter] for letter in shape) or "no tags"
        raise FormatError(f"tags {shown}, not <plan></plan>(<read></read>)+<edit></edit>")
    inside = texts[1::2]  # texts[k] precedes tag k: odd ones sit inside a tag pair
    outside = texts[0::2]
    if any(t.strip() for t in outside):
        raise FormatError("text outside the tags")
    if not inside[0].strip():
        raise FormatError("empty plan")
    return Trajectory(plan=inside[0], reads=[r.strip() for r in inside[1:-1]], edit=inside[-1])


def trajectory_parts(trajectory: Trajectory) -> list[str]:
    """The trajectory as corpus target parts (tokenizer.encode_parts), in the stage-2 planning rows' layout."""
    reads = [part for name in trajectory.reads for part in (READ, name, END_READ)]
    return [PLAN, trajectory.plan, END_PLAN, *reads, EDIT, trajectory.edit, END_EDIT]


def decode(tokenizer, ids: list[int]) -> str:
    """Generated ids up to <|im_end|> as text (agentic tokens as their strings); ids past the tokenizer's
    vocabulary (a decoder's spare embedding rows) decode to nothing."""
    ids = ids[: ids.index(SPECIAL_IDS[EOS])] if SPECIAL_IDS[EOS] in ids else ids
    return tokenizer.decode([i for i in ids if i < VOCAB_SIZE])
