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
import random
import unicodedata
from dataclasses import dataclass

import numpy as np

NEWLINE, CR = 10, 13


@dataclass(frozen=True)
class Chunk:
    path: str
    index: int
    start_line: int  # 1-based, inclusive
    end_line: int
    text: str  # header + body
    ids: list[int]


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
    ids_list = tokenizer.encode_text(text)
    ends = np.cumsum(tokenizer.token_byte_lengths()[np.asarray(ids_list, dtype=np.int64)])  # where each token ends
    raw = np.frombuffer(data, dtype=np.uint8)
    line_starts = np.concatenate([[0], np.flatnonzero(raw == NEWLINE) + 1])
    line_starts = line_starts[line_starts < len(data)]
    # Candidate cuts: k tokens before, where token k-1 ends at the start of a non-blank line.
    starts = line_starts[1:]
    if len(starts):  # both sorted: a token end is a line start where searchsorted finds it
        found = starts[np.minimum(np.searchsorted(starts, ends), len(starts) - 1)] == ends
        at_line = ends[found]
    else:
        at_line = ends[:0]
    at_line = at_line[(raw[at_line] != NEWLINE) & (raw[at_line] != CR)]
    cut_tokens = np.searchsorted(ends, at_line) + 1
    cut_lines = np.searchsorted(line_starts, at_line)  # 0-based line that starts there
    if boundaries:
        priority = np.fromiter((boundaries.get(int(n), 0) for n in cut_lines), dtype=np.int64, count=len(cut_lines))
    else:
        priority = (raw[np.maximum(at_line - 2, 0)] == NEWLINE).astype(np.int64)  # previous line blank

    cut_tokens, priority, ends_list = cut_tokens.tolist(), priority.tolist(), ends.tolist()  # bisect beats numpy
    line_list = line_starts.tolist()
    chunks: list[Chunk] = []
    start = 0
    while start < len(ids_list):
        head = header(path, len(chunks))
        head_ids = tokenizer.encode_text(head)
        budget = max(chunk_tokens - len(head_ids), 1)
        stop = len(ids_list) if len(ids_list) - start <= budget else best_token_cut(start, budget, cut_tokens, priority)
        if stop is None:  # no line starts within the budget: cut inside the line, at a character boundary
            stop = start + budget
            while stop > start + 1 and 0x80 <= data[ends_list[stop - 1]] < 0xC0:
                stop -= 1
        b0 = ends_list[start - 1] if start else 0
        b1 = ends_list[stop - 1]
        body = data[b0:b1].decode("utf-8")
        chunk_ids = head_ids + ids_list[start:stop]
        if body[:1] in ("\n", "\r"):  # only a file's first chunk can start with a line break: it would merge
            chunk_ids = tokenizer.encode_text(head + body)  # with the header's, so encode the seam as a reader does
        first = bisect.bisect_right(line_list, b0)  # 1-based line of the first byte
        last = bisect.bisect_right(line_list, b1 - 1)
        chunks.append(Chunk(path, len(chunks), first, last, head + body, chunk_ids))
        start = stop
    return chunks


def best_token_cut(start: int, budget: int, cut_tokens: list[int], priority: list[int]) -> int | None:
    """The latest highest-priority cut in (start + budget / 4, start + budget], else the latest cut after start."""
    lo = bisect.bisect_right(cut_tokens, start)
    hi = bisect.bisect_right(cut_tokens, start + budget)
    if hi <= lo:
        return None
    best, best_priority = cut_tokens[hi - 1], 0
    for k in range(hi - 1, max(lo, bisect.bisect_right(cut_tokens, start + budget // 4)) - 1, -1):
        if priority[k] > best_priority:
            best, best_priority = cut_tokens[k], priority[k]
            if best_priority >= 2:
                break
    return best


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
