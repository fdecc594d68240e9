"""Evaluation metrics: code completion (edit similarity, pass@k), rates with intervals, RULER string match, and
where the memory attention lands (the share on the evidence, whether the most-read chunk is evidence).

Plain functions of strings, counts and arrays, so every evaluation reports the same numbers the same way; the
attention maps may be numpy arrays or torch tensors (converted without importing torch here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from rapidfuzz.distance import Levenshtein

Spans = Sequence[tuple[int, int]]


def edit_similarity(prediction: str, reference: str) -> float:
    """1 - Levenshtein distance / max(len), in [0, 1]: RepoCoder/RepoEval's edit similarity, tolerant of a near miss
    that exact match scores 0. (RepoBench's and CrossCodeEval's scripts report fuzzywuzzy's fuzz.ratio instead: the
    insertion/deletion ratio over the summed lengths, x100, of stripped strings.) Both empty -> 1.0."""
    return float(Levenshtein.normalized_similarity(prediction, reference))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of Chen et al. 2021 from n samples of which c pass: 1 - C(n-c, k) / C(n, k), as the
    product 1 - prod_{i=n-c+1}^{n} (1 - k/i), which stays exact where the binomials overflow a float."""
    if n < 1 or k < 1:
        raise ValueError(f"pass@k needs n >= 1 and k >= 1, got n={n}, k={k}")
    if k > n:
        raise ValueError(f"pass@k needs k <= n (k={k} samples cannot be drawn from n={n})")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:  # every draw of k contains a passing sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def rate_interval(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95% at z=1.96) for a rate: unlike the normal approximation it stays inside [0, 1] and
    is not zero-width at 0/n or n/n, where small evaluation sets often land. total 0 -> (0.0, 1.0), nothing known."""
    if total < 0 or not 0 <= successes <= total:
        raise ValueError(f"need 0 <= successes <= total, got {successes}/{total}")
    if total == 0:
        return 0.0, 1.0
    p = successes / total
    z2 = z * z
    denominator = 1 + z2 / total
    centre = (p + z2 / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / denominator
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == total else min(1.0, centre + half)
    return low, high


def rate(successes: int, total: int, z: float = 1.96) -> dict[str, float | int]:
    """A rate as results.json records it: the value with its Wilson interval and the sample size."""
    low, high = rate_interval(successes, total, z)
    return {"value": successes / total if total else 0.0, "low": low, "high": high, "n": total}


def _occurs(reference: str, prediction: str) -> bool:
    return reference.lower() in prediction.lower()


def _check_pairs(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        raise ValueError("no samples to score")
    if any(len(refs) == 0 for refs in references):
        raise ValueError("every sample needs at least one reference string")


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_all as a fraction: per sample the share of its references found in the prediction
    (case-insensitive substring), averaged over samples. RULER prints it x100."""
    _check_pairs(predictions, references)
    return float(np.mean([sum(_occurs(r, p) for r in refs) / len(refs) for p, refs in zip(predictions, references)]))


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's string_match_part as a fraction: a sample scores 1 when any one of its references is found (the QA
    tasks, where each reference is an accepted answer), averaged over samples."""
    _check_pairs(predictions, references)
    return float(np.mean([max(_occurs(r, p) for r in refs) for p, refs in zip(predictions, references)]))


def _as_array(attention: Any) -> np.ndarray:
    """numpy or torch (bf16 included: .float() first; duck-typed, so torch is not imported here)."""
    if hasattr(attention, "detach"):
        attention = attention.detach().float().cpu().numpy()
    return np.asarray(attention, dtype=np.float64)


def _rows(attention: Any) -> np.ndarray:
    """(queries, positions) or (heads, queries, positions) -> (rows, positions), each row normalised to sum 1, so a
    slice of a larger softmax (memory positions only) counts as the share of what the query reads from memory."""
    array = _as_array(attention)
    if array.ndim < 2:
        raise ValueError(f"attention must be (queries, positions) or (heads, queries, positions), got {array.shape}")
    rows = array.reshape(-1, array.shape[-1])
    sums = rows.sum(-1, keepdims=True)
    if (rows < 0).any() or (sums <= 0).any():
        raise ValueError("attention rows must be non-negative with positive mass")
    return rows / sums


def _position_mask(evidence: Any, positions: int) -> np.ndarray:
    """A boolean mask over memory positions, or (start, stop) spans -> a boolean mask."""
    array = np.asarray(evidence)
    if array.dtype == bool:
        if array.shape != (positions,):
            raise ValueError(f"evidence mask has shape {array.shape}, attention has {positions} positions")
        return array
    mask = np.zeros(positions, dtype=bool)
    for start, stop in evidence:
        if not 0 <= start <= stop <= positions:
            raise ValueError(f"span ({start}, {stop}) outside the {positions} memory positions")
        mask[start:stop] = True
    return mask


def attention_mass(attention: Any, evidence: Any) -> float:
    """The share of the attention mass on the evidence positions, averaged over queries (and heads): 1 when the
    model reads only the evidence, the evidence's share of the memory when it reads uniformly."""
    rows = _rows(attention)
    return float(rows[:, _position_mask(evidence, rows.shape[-1])].sum(-1).mean())


def _chunk_ids(chunks: Any, positions: int) -> tuple[np.ndarray, int]:
    """chunk spans [(start, stop), ...] or a chunk id per position (-1: in no chunk) -> (ids, number of chunks)."""
    array = np.asarray(chunks)
    if array.ndim == 1:
        if array.shape != (positions,):
            raise ValueError(f"chunk_of_position has shape {array.shape}, attention has {positions} positions")
        return array.astype(np.int64), int(array.max()) + 1
    ids = np.full(positions, -1, dtype=np.int64)
    for index, (start, stop) in enumerate(chunks):
        if not 0 <= start <= stop <= positions:
            raise ValueError(f"chunk ({start}, {stop}) outside the {positions} memory positions")
        ids[start:stop] = index
    return ids, len(chunks)


def chunk_mass(attention: Any, chunks: Any) -> np.ndarray:
    """The attention mass per chunk (averaged over queries and heads); positions in no chunk count for none."""
    rows = _rows(attention)
    ids, count = _chunk_ids(chunks, rows.shape[-1])
    mass = rows.mean(0)
    inside = ids >= 0
    return np.bincount(ids[inside], weights=mass[inside], minlength=count)


def top_chunk_is_evidence(attention: Any, chunks: Any, evidence_chunks: Sequence[int]) -> bool:
    """Whether the chunk the model reads most is an evidence chunk; averaged over samples it is a retrieval
    accuracy that needs no decoding."""
    return int(np.argmax(chunk_mass(attention, chunks))) in set(evidence_chunks)


def evidence_reading(layer_maps: Sequence[Any], chunks: Any, evidence_chunks: Sequence[int]) -> tuple[float, bool]:
    """Memory-attention accuracy of one query read by several GCA layers: (attention mass on the evidence chunks,
    whether the most-read chunk is one of them) in the layer that puts the most mass on the evidence, since one layer
    usually carries retrieval (the others read elsewhere). `chunks` are (start, stop) spans of memory
    positions; each map is (heads, positions) or (heads, queries, positions)."""
    spans = [chunks[c] for c in evidence_chunks]
    return max((attention_mass(m, spans), top_chunk_is_evidence(m, chunks, evidence_chunks)) for m in layer_maps)
