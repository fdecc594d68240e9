"""Memory chunks of at most `chunk_tokens` tokens, each prefixed with its path and chunk id, cut at syntax
boundaries where possible (tree-sitter top-level nodes, then their children), at paragraph breaks or lines
otherwise.

The file is encoded once; chunks are cut in token space, at tokens that end where a non-blank line begins. Such a
cut is a boundary of Qwen's pre-tokenizer (a line break always ends a pre-token and nothing before it looks back),
so a chunk's `ids` (header ids + its slice) are exactly `tokenizer.encode_text(text)` and a reader who
re-tokenizes the `memory` column gets `memory_input_ids`. Only a line longer than a whole chunk is cut inside
(at a character boundary); there `ids` still decode to `text` exactly.
"""

from __future__ import annotations

import bisect
import functools
import random
import unicodedata
from dataclasses import dataclass, field

import numpy as np

NEWLINE, CR = 10, 13


@dataclass(frozen=True)
class Chunk:
    path: str
    index: int
    start_line: int  # 1-based, inclusive
    end_line: int
    text: str  # header + body
    ids: np.ndarray = field(compare=False)  # int32; compare with `same_chunks`


def header(path: str, index: int) -> str:
    """The line every chunk starts with; a `<read>` action names a chunk by this text (without the newline)."""
    return f"### {path} [chunk {index}]\n"


def chunk_name(path: str, index: int) -> str:
    return header(path, index).strip()


def chunk_file(path: str, text: str, tokenizer, *, chunk_tokens: int = 512,
               boundaries: dict[int, int] | None = None) -> list[Chunk]:
    """Chunks of one file (NFC-normalised, as the tokenizer sees it). boundaries: 0-based line -> priority
    (2 top-level node starts, 1 nested), from syntax; without them a line after a blank line has priority 1."""
    text = unicodedata.normalize("NFC", text)
    data = text.encode("utf-8")
    if not data:
        return []
    ids = tokenizer.encode_array(text)
    ends = np.cumsum(tokenizer.token_byte_lengths()[ids], dtype=np.int64)  # the byte offset where each token ends
    raw = np.frombuffer(data, dtype=np.uint8)
    breaks = np.flatnonzero(raw == NEWLINE)  # a byte's 0-based line = the line breaks before it
    # Candidate cuts, after token k-1: it ends where a non-blank line starts (a line break just before, no line
    # break or CR at it). The last token ends the file and is never a cut.
    inner = ends[:-1]
    cut_index = np.flatnonzero((raw[inner - 1] == NEWLINE) & (raw[inner] != NEWLINE) & (raw[inner] != CR))
    at_line = inner[cut_index]
    if boundaries:
        lines = np.searchsorted(breaks, at_line).tolist()
        priority = np.fromiter((boundaries.get(n, 0) for n in lines), dtype=np.int64, count=len(lines))
    else:
        priority = (raw[np.maximum(at_line - 2, 0)] == NEWLINE).astype(np.int64)  # previous line blank
    cut_tokens = cut_index + 1
    cuts = [cut_tokens.tolist()] + [cut_tokens[priority == level].tolist() for level in range(1, 3)]

    header_ids = HeaderIds(path, tokenizer)
    spans, heads = [], []  # token [start, stop) of each chunk's body, its header ids
    start, n = 0, len(ids)
    while start < n:
        heads.append(header_ids(len(spans)))
        budget = max(chunk_tokens - len(heads[-1]), 1)
        stop = n if n - start <= budget else best_token_cut(start, budget, cuts)
        if stop is None:  # no line starts within the budget: cut inside the line, at a character boundary
            stop = start + budget
            while stop > start + 1 and 0x80 <= data[ends[stop - 1]] < 0xC0:
                stop -= 1
        spans.append((start, stop))
        start = stop
    token_spans = np.asarray(spans)
    byte_ends = ends[token_spans[:, 1] - 1]
    byte_starts = np.concatenate(([0], byte_ends[:-1]))
    first_lines = np.searchsorted(breaks, byte_starts) + 1  # 1-based
    last_lines = np.searchsorted(breaks, byte_ends - 1) + 1
    chunks: list[Chunk] = []
    for index, ((start, stop), head_ids, b0, b1, first, last) in enumerate(zip(
            spans, heads, byte_starts.tolist(), byte_ends.tolist(), first_lines.tolist(), last_lines.tolist())):
        head, body = header(path, index), data[b0:b1].decode("utf-8")
        if body[:1] in ("\n", "\r"):  # only a file's first chunk can start with a line break: it would merge
            chunk_ids = tokenizer.encode_array(head + body)  # with the header's, so encode the seam as a reader does
        else:
            chunk_ids = np.concatenate((head_ids, ids[start:stop]))
        chunks.append(Chunk(path, index, first, last, head + body, chunk_ids))
    return chunks


def best_token_cut(start: int, budget: int, cuts: list[list[int]]) -> int | None:
    """The latest cut of the highest priority in (start + budget / 4, start + budget], else the latest cut in
    (start, start + budget]; None if there is none. cuts[0]: every cut, cuts[p]: those of priority p, sorted."""
    limit, floor = start + budget, start + budget // 4
    for level in range(len(cuts) - 1, 0, -1):
        i = bisect.bisect_right(cuts[level], limit)
        if i and cuts[level][i - 1] > floor:
            return cuts[level][i - 1]
    i = bisect.bisect_right(cuts[0], limit)
    return cuts[0][i - 1] if i and cuts[0][i - 1] > start else None


class HeaderIds:
    """The ids of a file's chunk headers without encoding each: `### {path}`, then ` [chunk {i}]\n` from a
    process-wide cache. Their seam is a pre-tokenizer boundary unless the path ends in whitespace (Qwen's regex
    joins a space run to what follows); such paths, and any other whose chunk-0 header the parts do not
    reproduce, are encoded whole."""

    def __init__(self, path: str, tokenizer):
        self.path, self.tokenizer = path, tokenizer
        self.prefix = tokenizer.encode_array(f"### {path}")
        if not path[-1:].isalnum() and not np.array_equal(self.joined(0), tokenizer.encode_array(header(path, 0))):
            self.prefix = None

    def joined(self, index: int) -> np.ndarray:
        return np.concatenate((self.prefix, header_suffix_ids(self.tokenizer, index)))

    def __call__(self, index: int) -> np.ndarray:
        if self.prefix is None:
            return self.tokenizer.encode_array(header(self.path, index))
        return self.joined(index)


@functools.lru_cache(maxsize=8192)
def header_suffix_ids(tokenizer, index: int) -> np.ndarray:
    return tokenizer.encode_array(f" [chunk {index}]\n")


def same_chunks(a: list[Chunk], b: list[Chunk]) -> bool:
    """Equal chunk lists, token ids included."""
    return a == b and all(np.array_equal(x.ids, y.ids) for x, y in zip(a, b))


def chunks_covering(chunks: list[Chunk], path: str, start_line: int, end_line: int) -> list[Chunk]:
    return [c for c in chunks if c.path == path and c.start_line <= end_line and c.end_line >= start_line]


def select_memory(evidence: list[Chunk], pool: list[Chunk], max_chunks: int, seed: int) -> list[Chunk]:
    """The memory budget: every evidence chunk, then distractors from the same repository up to max_chunks,
    in a seeded random order (so the evidence sits at varying depths)."""
    rng = random.Random(seed)
    keep = {(c.path, c.index) for c in evidence}
    others = [c for c in pool if (c.path, c.index) not in keep]
    room = max(0, max_chunks - len(evidence))
    memory = list(evidence) + rng.sample(others, min(room, len(others)))
    rng.shuffle(memory)
    return memory
