"""Memory chunks of about `chunk_tokens` tokens, each prefixed with its path and chunk id, cut at syntax
boundaries where possible (tree-sitter top-level nodes, then their children), at lines otherwise.

Each chunk's `ids` are exactly `tokenizer.encode_text(text)` (the header included), so a reader who re-tokenizes
the `memory` column gets `memory_input_ids`. Sizing uses a running chars-per-token estimate and each chunk is
encoded once; a chunk that comes out above `1.25 * chunk_tokens` is split again at lines.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


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
    """Chunks of one file. boundaries: 0-based line -> priority (2 top-level node starts, 1 nested), from syntax."""
    lines = text.splitlines(keepends=True)
    boundaries = boundaries or {}
    chars_per_token = 3.5
    budget = chunk_tokens - 24  # room for the header
    pieces: list[tuple[int, int]] = []  # (start, end) line ranges, end exclusive
    start, size = 0, 0
    for n, line in enumerate(lines):
        size += len(line)
        if size / chars_per_token > budget and n > start:
            cut = best_cut(start, n, boundaries)
            pieces.append((start, cut))
            start, size = cut, sum(len(x) for x in lines[cut : n + 1])
    if start < len(lines):
        pieces.append((start, len(lines)))
    chunks: list[Chunk] = []
    queue = list(pieces)
    while queue:
        s, e = queue.pop(0)
        body = "".join(lines[s:e])
        text_ = header(path, len(chunks)) + body
        ids = tokenizer.encode_text(text_)
        if len(ids) > 1.25 * chunk_tokens and e - s > 1:  # estimate was off: split at the middle line
            mid = min(max(best_cut(s, (s + e) // 2 + 1, boundaries), s + 1), e - 1)  # both halves non-empty
            queue[:0] = [(s, mid), (mid, e)]
            continue
        if len(ids) > 1.25 * chunk_tokens:  # one huge line (minified): cut by characters
            step = max(1, int(len(body) * chunk_tokens / len(ids)))
            for k in range(0, len(body), step):
                part = header(path, len(chunks)) + body[k : k + step]
                chunks.append(Chunk(path, len(chunks), s + 1, e, part, tokenizer.encode_text(part)))
            continue
        chunks.append(Chunk(path, len(chunks), s + 1, max(e, s + 1), text_, ids))
        chars_per_token = 0.7 * chars_per_token + 0.3 * max(len(body), 1) / max(len(ids), 1)
    return chunks


def best_cut(start: int, end: int, boundaries: dict[int, int]) -> int:
    """The latest highest-priority boundary in (start + quarter, end], else end (a line cut)."""
    lo = start + max(1, (end - start) // 4)
    best, best_priority = end, 0
    for line in range(end, lo - 1, -1):
        priority = boundaries.get(line, 0)
        if priority > best_priority:
            best, best_priority = line, priority
            if priority >= 2:
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
