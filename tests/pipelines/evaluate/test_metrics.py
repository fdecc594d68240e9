"""Each metric against a case computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipelines.evaluate.metrics import (
    attention_mass,
    chunk_mass,
    edit_similarity,
    pass_at_k,
    rate,
    rate_interval,
    string_match_all,
    string_match_part,
    top_chunk_is_evidence,
)


def test_edit_similarity():
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)  # k->s, e->i, +g
    assert edit_similarity("return x", "return x") == 1.0
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("abc", "") == 0.0
    assert edit_similarity("", "abc") == 0.0


def test_pass_at_k():
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert pass_at_k(5, 1, 5) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(200, 13, 10) == pytest.approx(1 - math.comb(187, 10) / math.comb(200, 10))
    for n, c, k in [(5, 1, 6), (5, 6, 1), (5, -1, 1), (5, 1, 0), (0, 0, 0)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_rate_interval_wilson():
    # 8/10: p=0.8, z^2=3.8416, centre=(0.8+0.19208)/1.38416=0.716738,
    # half=1.96*sqrt(0.016+0.009604)/1.38416=0.226581
    low, high = rate_interval(8, 10)
    assert low == pytest.approx(0.490157, abs=1e-6)
    assert high == pytest.approx(0.943319, abs=1e-6)
    # 0/10: centre = half = 0.19208/1.38416 = 0.138770
    assert rate_interval(0, 10) == (0.0, pytest.approx(2 * 0.19208 / 1.38416))
    assert rate_interval(10, 10) == (pytest.approx(1 - 2 * 0.19208 / 1.38416), 1.0)
    assert rate_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        rate_interval(3, 2)


def test_rate_record():
    record = rate(8, 10)
    assert record["value"] == 0.8 and record["n"] == 10
    assert (record["low"], record["high"]) == pytest.approx(rate_interval(8, 10))
    assert rate(0, 0) == {"value": 0.0, "low": 0.0, "high": 1.0, "n": 0}


def test_ruler_string_match():
    predictions = ["The numbers are 4 0 7 and 9 9 9.", "the special magic number is 42"]
    references = [["4 0 7", "1 2 3"], ["42"]]
    assert string_match_all(predictions, references) == pytest.approx((1 / 2 + 1) / 2)
    assert string_match_part(predictions, references) == 1.0
    # case-insensitive; the second sample finds neither reference
    assert string_match_all(["PARIS", "no idea"], [["paris"], ["Rome", "Milan"]]) == 0.5
    assert string_match_part(["PARIS", "no idea"], [["paris"], ["Rome", "Milan"]]) == 0.5
    assert string_match_all(["a b c"], [["a", "b", "x", "y"]]) == 0.5
    with pytest.raises(ValueError):
        string_match_all(["a"], [["a"], ["b"]])


# 2 queries over 6 memory positions in 3 chunks of 2 (rows sum to 1)
ATTENTION = np.array([
    [0.10, 0.10, 0.50, 0.10, 0.10, 0.10],  # chunk masses 0.2, 0.6, 0.2
    [0.05, 0.05, 0.20, 0.20, 0.30, 0.20],  # chunk masses 0.1, 0.4, 0.5
])
CHUNKS = [(0, 2), (2, 4), (4, 6)]


def test_attention_mass_on_evidence():
    # evidence = chunk 1 (positions 2, 3): mean(0.6, 0.4)
    assert attention_mass(ATTENTION, [(2, 4)]) == pytest.approx(0.5)
    mask = np.array([False, False, True, True, False, False])
    assert attention_mass(ATTENTION, mask) == pytest.approx(0.5)
    assert attention_mass(ATTENTION, [(0, 1), (4, 6)]) == pytest.approx((0.3 + 0.55) / 2)
    # a second head reading uniformly puts 2/6 on the evidence: (0.6 + 0.4 + 1/3 + 1/3) / 4
    heads = np.stack([ATTENTION, np.full((2, 6), 1 / 6)])
    assert attention_mass(heads, [(2, 4)]) == pytest.approx(5 / 12)
    # rows are shares of the memory attention: a slice of a larger softmax scales out
    assert attention_mass(ATTENTION * 0.25, [(2, 4)]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        attention_mass(ATTENTION, [(4, 7)])


def test_chunk_mass_and_top_chunk():
    assert chunk_mass(ATTENTION, CHUNKS) == pytest.approx([0.15, 0.5, 0.35])
    assert chunk_mass(ATTENTION, [0, 0, 1, 1, 2, 2]) == pytest.approx([0.15, 0.5, 0.35])
    assert chunk_mass(ATTENTION, [-1, -1, 0, 0, 1, 1]) == pytest.approx([0.5, 0.35])  # first 2 in no chunk
    assert top_chunk_is_evidence(ATTENTION, CHUNKS, [1])
    assert not top_chunk_is_evidence(ATTENTION, CHUNKS, [2])
    assert top_chunk_is_evidence(ATTENTION, CHUNKS, [0, 1])


def test_attention_metrics_take_torch_tensors():
    torch = pytest.importorskip("torch")
    attention = torch.tensor(ATTENTION, dtype=torch.bfloat16, requires_grad=True)
    assert attention_mass(attention, [(2, 4)]) == pytest.approx(0.5, abs=1e-2)
    assert chunk_mass(attention, CHUNKS) == pytest.approx([0.15, 0.5, 0.35], abs=1e-2)
    assert top_chunk_is_evidence(attention, CHUNKS, [1])
