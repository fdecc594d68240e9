"""A corpus of random token rows in jobs/build_corpus.py's schema, with its manifest: training and memory
measurements at real shapes (the GPU checks: proto1's memory plan, a stage-2 run) without building a corpus. What
the rows say is noise; their lengths are what is measured: every row fills `max_tokens` decoder tokens (a prompt,
then a target the loss reads) and `chunks` full memory chunks of `chunk_len`, so packing puts one row in each
packed row and every position is real."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipelines.format.rows import IGNORE
from pipelines.format.shards import write_corpus

FIRST_ID = 5  # ids below stay clear of special tokens; the pad id (0) never appears


def random_rows(n: int, *, max_tokens: int, chunks: int, chunk_len: int, vocab: int, seed: int) -> list[dict]:
    """n rows of exactly `max_tokens` decoder tokens (the first quarter a prompt, the rest target) and `chunks`
    memory chunks of `chunk_len` tokens, ids drawn from [FIRST_ID, vocab)."""
    rng = np.random.default_rng(seed)
    prompt = max_tokens // 4
    rows = []
    for i in range(n):
        ids = rng.integers(FIRST_ID, vocab, size=max_tokens).tolist()
        memory = rng.integers(FIRST_ID, vocab, size=(chunks, chunk_len)).tolist()
        rows.append({"task": "commit", "variant": "raw", "prompt": f"random {i}", "target": "",
                     "input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:], "memory_input_ids": memory})
    return rows


def write_random_corpus(out: str | Path, *, rows: int, max_tokens: int, chunks: int, chunk_len: int, vocab: int,
                        val_rows: int = 0, seed: int = 0, stage: int = 2) -> Path:
    """OUT/train (and OUT/val with `val_rows`) and OUT/manifest.json (pipelines.format.shards.write_corpus);
    returns OUT/train."""
    shapes = dict(max_tokens=max_tokens, chunks=chunks, chunk_len=chunk_len, vocab=vocab)
    splits = {"train": random_rows(rows, seed=seed, **shapes)}
    if val_rows:
        splits["val"] = random_rows(val_rows, seed=seed + 1, **shapes)
    write_corpus(out, splits, row_group_rows=8, stage=stage, sources=["random"])
    return Path(out) / "train"
