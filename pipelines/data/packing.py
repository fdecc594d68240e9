"""Corpus rows -> packed training batches for the GCA model.

A corpus row (jobs/build_corpus.py) holds `input_ids` (prompt + target), `labels` (-100 on the prompt) and
`memory_input_ids` (one token list per memory chunk). Short examples are packed several to a decoder row, so a step
spends its compute on tokens, not padding; each example's chunks travel with it into the row's memory, and segment
ids keep every token reading only its own example's chunks (models/gca.py MemoryPadding.packed), while position_ids
restarting at 0 keep self-attention inside the example.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from pipelines.format.rows import IGNORE


@dataclass(frozen=True)
class PackingSpec:
    max_tokens: int = 1024  # decoder tokens per packed row
    max_chunks: int = 16  # memory chunks per packed row
    chunk_len: int = 512  # tokens per memory chunk (longer chunks are cut, shorter ones padded)
    pad_id: int = 0


@dataclass
class PackStats:
    """What packing had to cut, so a run reports it instead of hiding it."""

    examples: int = 0
    rows: int = 0
    truncated_tokens: int = 0  # examples whose prompt + target exceeded max_tokens
    dropped_chunks: int = 0  # memory chunks beyond max_chunks for one example
    cut_chunks: int = 0  # chunks longer than chunk_len
    real_tokens: int = 0
    padded_tokens: int = 0


def pack_examples(examples: Iterable[dict], spec: PackingSpec, stats: PackStats | None = None) -> list[list[dict]]:
    """Greedy first-fit in arrival order: an example joins the current row while the row's tokens and chunks
    still fit, else starts a new row. Deterministic, so a resumed run packs exactly as the first run did."""
    stats = stats if stats is not None else PackStats()
    rows: list[list[dict]] = []
    tokens = chunks = 0
    for example in examples:
        example = _fit(example, spec, stats)
        n, c = len(example["input_ids"]), len(example["memory_input_ids"])
        if not rows or tokens + n > spec.max_tokens or chunks + c > spec.max_chunks:
            rows.append([])
            tokens = chunks = 0
        rows[-1].append(example)
        tokens, chunks = tokens + n, chunks + c
    stats.rows += len(rows)
    return rows


def _fit(example: dict, spec: PackingSpec, stats: PackStats) -> dict:
    input_ids, labels = list(example["input_ids"]), list(example["labels"])
    if len(input_ids) != len(labels):
        raise ValueError(f"a corpus row has {len(input_ids)} input_ids but {len(labels)} labels: rebuild the corpus")
    stats.examples += 1
    if len(input_ids) > spec.max_tokens:
        stats.truncated_tokens += 1
        input_ids, labels = input_ids[: spec.max_tokens], labels[: spec.max_tokens]
    chunks = [list(chunk) for chunk in example["memory_input_ids"]]
    if len(chunks) > spec.max_chunks:
        stats.dropped_chunks += len(chunks) - spec.max_chunks
        chunks = chunks[: spec.max_chunks]  # the corpus puts the evidence chunks first
    for i, chunk in enumerate(chunks):
        if len(chunk) > spec.chunk_len:
            stats.cut_chunks += 1
            chunks[i] = chunk[: spec.chunk_len]
    kept = {"input_ids": input_ids, "labels": labels, "memory_input_ids": chunks}
    return kept | ({"id": example["id"]} if "id" in example else {})  # the row id joins stage 4's teacher entries


def collate_packed(rows: list[list[dict]], spec: PackingSpec,
                   stats: PackStats | None = None) -> dict[str, torch.Tensor]:
    """Packed rows -> the tensors AwarenessModel.forward takes (padding: segment -1, label -100, masked chunks).

    A batch whose every row is one example filling it comes back as plain rows: no segment ids, default positions,
    and a memory mask only where a chunk is short. The loss is the same; what changes is that attention needs no
    mask, so SDPA can take its flash and cuDNN kernels (a packed row's block-causal mask and the memory's per-token
    mask keep the decoder and the GCA blocks on the masked kernels)."""
    b = max(len(rows), 1)
    t = max((sum(len(e["input_ids"]) for e in row) for row in rows), default=1)
    c = max((sum(len(e["memory_input_ids"]) for e in row) for row in rows), default=1)
    c = max(c, 1)
    input_ids = torch.full((b, t), spec.pad_id, dtype=torch.long)
    labels = torch.full((b, t), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((b, t), dtype=torch.long)
    segment_ids = torch.full((b, t), -1, dtype=torch.long)
    memory = torch.full((b, c, spec.chunk_len), spec.pad_id, dtype=torch.long)
    memory_mask = torch.zeros((b, c, spec.chunk_len), dtype=torch.long)
    memory_segments = torch.full((b, c), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        offset = chunk = 0
        for s, example in enumerate(row):
            n = len(example["input_ids"])
            input_ids[r, offset : offset + n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
            labels[r, offset : offset + n] = torch.as_tensor(example["labels"], dtype=torch.long)
            position_ids[r, offset : offset + n] = torch.arange(n)
            segment_ids[r, offset : offset + n] = s
            offset += n
            for tokens in example["memory_input_ids"]:
                memory[r, chunk, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
                memory_mask[r, chunk, : len(tokens)] = 1
                memory_segments[r, chunk] = s
                chunk += 1
        if row:  # padding continues the last example's positions: transformers sees no extra sequence start
            position_ids[r, offset:] = torch.arange(n, n + t - offset)
    if stats is not None:
        stats.real_tokens += int((segment_ids >= 0).sum())
        stats.padded_tokens += int((segment_ids < 0).sum())
    if bool((segment_ids == 0).all()):  # one example a row, no padding: plain rows (unpacked)
        plain = {"input_ids": input_ids, "labels": labels, "memory_input_ids": memory}
        return plain if bool(memory_mask.all()) else plain | {"memory_attention_mask": memory_mask}
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "memory_input_ids": memory,
        "memory_attention_mask": memory_mask,
        "memory_segment_ids": memory_segments,
    }
