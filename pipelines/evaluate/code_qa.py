"""The code_qa suite: questions about repositories no system trained on (the val split of a stage-0 corpus,
jobs/build_corpus.py --stage 0), answered by greedy generation as each system reads its memory, and scored by

- exact match per question kind (`code_qa/exact/<kind>`: defines, params, method_of, returns, raises, callers,
  constant, section, definition, and the needle rows as `needle_<variant>`): the answer after the generation's
  `<read>` actions equals the row's answer, whitespace-normalised;
- `<read>` compliance on rows whose target is agentic (`code_qa/read_compliance`): the generation reads a chunk that
  holds the evidence (the row's `evidence_chunks`) before it answers;
- memory-attention accuracy for gca (`code_qa/attention/evidence_mass`, `.../top_chunk`): at the prompt's last token,
  the share of GCA attention mass on the evidence chunks and whether the most-read chunk is one of them.

A system sees a row as training showed it to that system (`streams.collate_memory_mode`): gca reads the chunks
through the encoder, in_context/rag get them (or their top-k) before the prompt, none gets the prompt alone. A
registered version answers through its pyfunc, text in (the prompt and the chunk texts) and text out.
`CodeQaEvaluation` runs `score_rows` inside Ray Data actors (`CodeQaScorer`); `score_rows` takes no Ray, so a
test calls it directly.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from pipelines.data.batch_inference import items_dataset, map_with_actors
from pipelines.data.streams import prompt_inputs
from pipelines.evaluate import probes
from pipelines.evaluate.common import Source, SuiteResult, System, Workers, batch_columns, load_system
from pipelines.evaluate.metrics import evidence_reading, rate_interval
from pipelines.format.shards import MANIFEST, RankReader, ShardError, check_split
from pipelines.format.tokenizer import END_READ, EOS, READ, SPECIAL_IDS, VOCAB_SIZE, cached_tokenizer

TASKS = ("code_qa", "doc_qa", "needle")  # the stage-0 row tasks (pipelines.corpora)
COLUMNS = ["task", "variant", "kind", "prompt", "target", "answer", "memory", "evidence_chunks", "unit", "input_ids",
           "labels", "memory_input_ids"]
BUILD = "python jobs/build_corpus.py --stage 0 --sources SRC --out DIR"
LEADING_READ = re.compile(rf"\s*{re.escape(READ)}(.*?){re.escape(END_READ)}", re.S)
PAD_ID = 0  # as DataConfig.pad_id: pads the encoder's chunks (the memory mask hides it)


@dataclass
class CodeQaSuite:
    corpus: str | None = None  # a stage-0 corpus directory (jobs/build_corpus.py --out DIR): its val split is scored
    max_rows: int = 256  # the val split's first rows of `tasks`, in the shards' fixed order
    max_new_tokens: int = 64  # greedy tokens per answer, an agentic answer's <read> actions included
    tasks: list[str] = field(default_factory=lambda: list(TASKS))  # row tasks to ask: code_qa, doc_qa, needle
    # memory sizes: 1 is each row's own memory; m grows it to m times its chunks with other chunks of its repository
    multipliers: list[int] = field(default_factory=lambda: [1])
    seed: int = 0  # which chunks grow a memory, and where they go

    def problems(self) -> list[str]:
        p = []
        if not self.corpus:
            p.append(f"code_qa.corpus: name the stage-0 corpus whose val split holds the held-out repositories: "
                     f"--code_qa.corpus DIR (built by `{BUILD}`)")
        if self.max_rows < 1 or self.max_new_tokens < 1:
            p.append("code_qa.max_rows and code_qa.max_new_tokens must be positive")
        if not self.tasks or set(self.tasks) - set(TASKS):
            p.append(f"code_qa.tasks {self.tasks} must name some of {TASKS}")
        if not self.multipliers or any(m < 1 for m in self.multipliers):
            p.append(f"code_qa.multipliers {self.multipliers} must be positive (1: each row's own memory)")
        return p


# ---------------------------------------------------------------------------------------------- the rows
def held_out(suite: CodeQaSuite) -> tuple[list[dict[str, Any]], dict[str, list[tuple[str, list[int]]]]]:
    """The first `max_rows` rows of the corpus's val split whose task is asked and, when a size above 1x is asked, the
    chunk pools their memories grow from (every distinct chunk, text and token ids, of each of their repositories:
    the chunks of its Q&A rows' memories, as the repository holds them, not a needle row's, which carry its needle;
    in the shards' order, one per chunk name), in one pass over the split. The corpus is checked first
    (held_out_reader): FileNotFoundError naming the fix."""
    reader, rows, chunks = held_out_reader(suite), [], {}
    grow = any(m > 1 for m in suite.multipliers)
    selected: set[str] = set()
    for shard_unit in reader.units:
        if len(rows) >= suite.max_rows and not grow:
            break
        for row in reader.read(shard_unit):
            if len(rows) < suite.max_rows and row["task"] in suite.tasks:
                rows.append(row)
                selected.add(row["unit"])
            # until the rows are chosen any repository may be one of theirs; after, only theirs are kept
            if grow and row["task"] != "needle" and (len(rows) < suite.max_rows or row["unit"] in selected):
                seen = chunks.setdefault(row["unit"], {})
                for text, ids in zip(row["memory"], row["memory_input_ids"], strict=True):
                    seen.setdefault(chunk_name(text), (text, list(ids)))
    if not rows:
        raise FileNotFoundError(f"--code_qa.corpus {suite.corpus}: its val split holds no rows of tasks {suite.tasks}")
    return rows, {unit: list(chunks.get(unit, {}).values()) for unit in selected} if grow else {}


def held_out_reader(suite: CodeQaSuite) -> RankReader:
    """A reader of the corpus's val split, checked: a stage-0 corpus with held-out repositories whose val shards match
    the manifest (sizes)."""
    root = Path(suite.corpus or "").expanduser()
    if not (root / MANIFEST).is_file():
        what = "no such directory" if not root.is_dir() else f"not a corpus (no {MANIFEST})"
        raise FileNotFoundError(f"--code_qa.corpus {root}: {what}; build one with `{BUILD}` and pass DIR")
    manifest = json.loads((root / MANIFEST).read_text())
    if manifest.get("stage") != 0:
        raise FileNotFoundError(f"--code_qa.corpus {root} is a stage-{manifest.get('stage')} corpus; code_qa asks "
                                f"stage 0's questions: build one with `{BUILD}`")
    if not any(name.startswith("val/") for name in manifest.get("shards", {})):
        raise FileNotFoundError(
            f"--code_qa.corpus {root} has no val split: all {len(manifest.get('repositories', {}).get('train', []))} "
            f"of its repositories went to train; rebuild it from more repositories (--per_subdir true splits a "
            f"source by its first-level directories) or with a larger --stage0.val_fraction")
    try:
        split = check_split(root / "val", hashes=False)
    except ShardError as error:
        raise FileNotFoundError(f"--code_qa.corpus {root}: {error}") from error
    return RankReader(split, 0, 1, columns=COLUMNS)


# ---------------------------------------------------------------------------------------------- grown memories
def chunk_name(text: str) -> str:
    """A memory chunk's name: its first line (`### path [chunk i]`)."""
    return text.split("\n", 1)[0].strip()


def grow_memory(row: dict[str, Any], pool: list[tuple[str, list[int]]], multiplier: int,
                rng: np.random.Generator) -> dict[str, Any]:
    """The row with its memory grown to `multiplier` times its chunks by other chunks of its repository (hard
    distractors: the same code's other definitions, its callers, its docs), drawn and placed by `rng`; as far as the
    repository goes when it has fewer. Its own chunks stay whole and in their order among the others."""
    own = list(zip(row["memory"], (list(ids) for ids in row["memory_input_ids"]), strict=True))
    names = {chunk_name(text) for text, _ in own}
    others = [chunk for chunk in pool if chunk_name(chunk[0]) not in names]
    drawn = [others[i] for i in rng.permutation(len(others))[: (multiplier - 1) * len(own)]]
    # the row's own chunks' places
    slots = set(rng.choice(len(own) + len(drawn), size=len(own), replace=False).tolist())
    own_iter, drawn_iter = iter(own), iter(drawn)
    memory = [next(own_iter) if position in slots else next(drawn_iter) for position in range(len(own) + len(drawn))]
    return {**row, "memory": [text for text, _ in memory], "memory_input_ids": [ids for _, ids in memory],
            "multiplier": multiplier}


def sized_rows(suite: CodeQaSuite, rows: list[dict[str, Any]],
               pools: dict[str, list[tuple[str, list[int]]]]) -> list[dict[str, Any]]:
    """The rows at every size in `suite.multipliers` (1: as the corpus holds them), each tagged with its multiplier;
    grown from their repositories' `pools` (held_out)."""
    sized = [{**row, "multiplier": 1} for row in rows] if 1 in suite.multipliers else []
    for multiplier in sorted(m for m in set(suite.multipliers) if m > 1):
        sized += [grow_memory(row, pools[row["unit"]], multiplier, np.random.default_rng([suite.seed, multiplier, i]))
                  for i, row in enumerate(rows)]
    return sized


def question_kind(row: dict[str, Any]) -> str:
    """What a row asks: its fact kind (defines, section, ...), or for a needle `needle_<variant>`."""
    return f"needle_{row['variant']}" if row["task"] == "needle" else row["kind"]


def is_agentic(row: dict[str, Any]) -> bool:
    return READ in row["target"]


def evidence_indices(row: dict[str, Any]) -> list[int]:
    """The positions in the row's memory of its evidence chunks (a chunk's first line is its name)."""
    names = set(row["evidence_chunks"])
    return [i for i, text in enumerate(row["memory"]) if chunk_name(text) in names]


# ---------------------------------------------------------------------------------------------- scoring
def answer_of(text: str) -> str:
    """The answer in a generation: what follows its last `</read>`, whitespace-normalised."""
    return " ".join(text.rpartition(END_READ)[2].split())


def read_compliance(text: str, evidence_chunks: list[str]) -> bool:
    """Whether the generation reads a chunk holding the evidence before it answers: it opens with `<read>` actions
    (only whitespace around them), one names an evidence chunk, and an answer follows them."""
    position, names = 0, set()
    while match := LEADING_READ.match(text, position):
        names.add(match.group(1).strip())
        position = match.end()
    return bool(names & set(evidence_chunks)) and bool(text[position:].strip())


def score_answer(row: dict[str, Any], text: str) -> dict[str, Any]:
    """One row's scores from its generated text (attention left to the caller)."""
    agentic = is_agentic(row)
    return {"task": row["task"], "kind": question_kind(row), "unit": row["unit"], "agentic": agentic,
            "multiplier": int(row.get("multiplier", 1)), "memory_chunks": len(row["memory"]),
            "exact": answer_of(text) == " ".join(row["answer"].split()),
            "read": float(read_compliance(text, row["evidence_chunks"])) if agentic else math.nan,
            "evidence_mass": math.nan, "top_chunk": math.nan, "prompt": row["prompt"], "answer": row["answer"],
            "generated": text}


@torch.no_grad()
def generate_text(model, inputs: dict[str, torch.Tensor], max_new_tokens: int) -> str:
    """Greedy generation cut at `<|im_end|>`, as text (agentic tokens kept; ids past the tokenizer's, which a
    decoder's spare embedding rows can emit, dropped)."""
    eos = SPECIAL_IDS[EOS]
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=PAD_ID)
    ids = out[0, inputs["input_ids"].shape[1] :].tolist()
    ids = ids[: ids.index(eos)] if eos in ids else ids
    return cached_tokenizer(None).decode([i for i in ids if i < VOCAB_SIZE])


def attention_scores(model, inputs: dict[str, torch.Tensor], row: dict[str, Any]) -> dict[str, float]:
    """Memory-attention accuracy at the prompt's last token: mass on the evidence chunks and whether the top chunk
    is one, in the GCA layer that reads the evidence most (metrics.evidence_reading)."""
    maps = probes.memory_attention(model, **inputs)  # per layer (1, heads, chunks * chunk_len)
    count, length = inputs["memory_input_ids"].shape[1:]
    chunks = [(c * length, (c + 1) * length) for c in range(count)]
    mass, top = evidence_reading([m[0] for m in maps], chunks, evidence_indices(row))
    return {"evidence_mass": mass, "top_chunk": float(top)}


def score_rows(system: System, rows: list[dict[str, Any]], max_new_tokens: int) -> list[dict[str, Any]]:
    """Each row answered by the system and scored; a registered version's pyfunc answers them all
    at once from the prompt and the chunk texts (it shows no attention)."""
    if system.served is not None:
        texts = system.served.predict([{"question": row["prompt"], "memory": list(row["memory"])} for row in rows],
                                      params={"max_new_tokens": max_new_tokens})
        return [{"system": system.name, **score_answer(row, text)} for row, text in zip(rows, texts, strict=True)]
    scored = []
    for row in rows:
        inputs = {k: v.to(system.model.device) for k, v in prompt_inputs(row, system.mode).items()}
        result = {"system": system.name, **score_answer(row, generate_text(system.model, inputs, max_new_tokens))}
        if system.mode.kind == "gca" and evidence_indices(row):
            result |= attention_scores(system.model, inputs, row)
        scored.append(result)
    return scored


class CodeQaScorer:
    """A Ray Data actor: loads one system, answers and scores batches of held-out corpus rows."""

    def __init__(self, name: str, export: str, system: dict[str, Any], max_new_tokens: int, use_gpu: bool,
                 served: str | None = None, tracking_uri: str | None = None):
        self.system = load_system(name, export, system, "cuda" if use_gpu else "cpu", served, tracking_uri)
        self.max_new_tokens = max_new_tokens

    def __call__(self, batch) -> dict[str, list]:
        rows = score_rows(self.system, batch.to_pylist(), self.max_new_tokens)  # batch: a pyarrow Table
        return batch_columns(rows)


def run_code_qa(settings: CodeQaSuite, source: Source, rows: list[dict[str, Any]],
                workers: Workers) -> list[dict[str, Any]]:
    scored = map_with_actors(
        items_dataset(rows, per_block=4), CodeQaScorer, actors=workers.actors, batch_size=4, batch_format="pyarrow",
        cpus_per_actor=workers.cpus_per_actor, use_gpu=workers.use_gpu,
        constructor_kwargs={"name": source.name, "export": source.export, "system": source.system,
                            "max_new_tokens": settings.max_new_tokens, "use_gpu": workers.use_gpu,
                            "served": source.served, "tracking_uri": workers.tracking_uri})
    return scored.take_all()


# ---------------------------------------------------------------------------------------------- results
def size_prefix(multiplier: int) -> str:
    """Where a size's metrics live: `code_qa/...` for the rows' own memories, `code_qa/<m>x/...` for grown ones."""
    return "code_qa" if multiplier == 1 else f"code_qa/{multiplier}x"


def multipliers_of(rows: list[dict[str, Any]]) -> list[int]:
    return sorted({int(r.get("multiplier", 1)) for r in rows})


def add_rate(metrics: dict[str, Any], counts: dict[str, int], name: str, hits: list[bool]) -> None:
    """A rate, its 95% Wilson interval (NAME/ci95) and its count."""
    metrics[name] = sum(hits) / len(hits)
    metrics[f"{name}/ci95"] = list(rate_interval(sum(hits), len(hits)))
    counts[name] = len(hits)


def code_qa_metrics(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, int]]:
    """metrics (rates with their 95% Wilson intervals) and counts, from the scored rows, per size (size_prefix), with
    the mean chunks of grown memories."""
    metrics: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for multiplier in multipliers_of(rows):
        sized = [r for r in rows if int(r.get("multiplier", 1)) == multiplier]
        prefix = size_prefix(multiplier)
        add_rate(metrics, counts, f"{prefix}/exact", [bool(r["exact"]) for r in sized])
        for kind in sorted({r["kind"] for r in sized}):
            add_rate(metrics, counts, f"{prefix}/exact/{kind}", [bool(r["exact"]) for r in sized if r["kind"] == kind])
        agentic = [r for r in sized if r["agentic"]]
        if agentic:
            add_rate(metrics, counts, f"{prefix}/read_compliance", [bool(r["read"]) for r in agentic])
        read = [r for r in sized if not math.isnan(r["evidence_mass"])]  # a gca system's rows
        if read:
            metrics[f"{prefix}/attention/evidence_mass"] = sum(r["evidence_mass"] for r in read) / len(read)
            counts[f"{prefix}/attention/evidence_mass"] = len(read)
            add_rate(metrics, counts, f"{prefix}/attention/top_chunk", [bool(r["top_chunk"]) for r in read])
        if multiplier > 1:  # a repository smaller than m memories grows its rows as far as it goes
            metrics[f"{prefix}/memory_chunks"] = sum(r["memory_chunks"] for r in sized) / len(sized)
            counts[f"{prefix}/memory_chunks"] = len(sized)
    return metrics, counts


def summary_line(name: str, metrics: dict[str, Any], counts: dict[str, int], multipliers: list[int]) -> str:
    """One line per system: exact match, read compliance and where gca's attention went, at each size."""
    parts = []
    for multiplier in sorted(multipliers):
        prefix = size_prefix(multiplier)
        size = "" if multiplier == 1 else f" at {multiplier}x ({metrics[f'{prefix}/memory_chunks']:.0f} chunks)"
        part = [f"code_qa{size} exact {metrics[f'{prefix}/exact']:.2f} (n={counts[f'{prefix}/exact']})"]
        if f"{prefix}/read_compliance" in metrics:
            part.append(f"read {metrics[f'{prefix}/read_compliance']:.2f} (n={counts[f'{prefix}/read_compliance']})")
        if f"{prefix}/attention/evidence_mass" in metrics:
            part.append(f"evidence mass {metrics[f'{prefix}/attention/evidence_mass']:.2f}  "
                        f"top chunk {metrics[f'{prefix}/attention/top_chunk']:.2f}")
        parts.append("  ".join(part))
    return f"{name}: " + "; ".join(parts)


class CodeQaEvaluation:
    """The suite for every system: the held-out rows read once (before any model is fetched, so a wrong corpus fails
    first), answered on `workers.actors` actors; every answer is written to OUT/code_qa_NAME.jsonl."""

    name: ClassVar[str] = "code_qa"

    def __init__(self, settings: CodeQaSuite, workers: Workers):
        self.settings, self.workers = settings, workers
        self.rows = sized_rows(settings, *held_out(settings))

    def run(self, source: Source) -> SuiteResult:
        rows = run_code_qa(self.settings, source, self.rows, self.workers)
        metrics, counts = code_qa_metrics(rows)
        with open(self.workers.out / f"code_qa_{source.name}.jsonl", "w") as answers:  # every answer, to read it
            answers.writelines(json.dumps(row) + "\n" for row in rows)
        return SuiteResult(metrics, counts, {}, summary_line(source.name, metrics, counts, multipliers_of(rows)))

    def close(self) -> None:
        pass
