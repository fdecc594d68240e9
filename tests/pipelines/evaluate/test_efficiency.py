"""The efficiency suite's own arithmetic (pipelines/evaluate/efficiency.py), on hand-written measurements: the
metrics' names and values, the printed line, the filler memory's shape, the median of timed calls after a warm-up,
and the peak memory of a block. Timing real systems: tests/pipelines/evaluate/test_needle.py (each memory mode) and
tests/pipelines/memory/test_store.py (gca from a memory store)."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import numpy as np

from pipelines.data.synthetic_needles import FILLER
from pipelines.evaluate import efficiency
from pipelines.evaluate.common import Source, Workers
from pipelines.evaluate.efficiency import EfficiencyEvaluation, EfficiencySuite, PeakRss, efficiency_metrics

ROWS = [{"memory_tokens": 96, "ttft_s": 0.010, "decode_s_per_token": 0.002, "peak_mib": 1.5, "encode_s": 0.004,
         "retrieval_s": 0.0, "encoder_chunks_per_s": 300.0},
        {"memory_tokens": 480, "ttft_s": 0.0205, "decode_s_per_token": 0.003, "peak_mib": 6.0, "encode_s": 0.02,
         "retrieval_s": 0.0, "encoder_chunks_per_s": 250.0}]


def test_metrics_per_memory_size_and_the_best_encoder_speed():
    metrics = efficiency_metrics(ROWS)
    assert metrics == {
        "efficiency/ttft_s/96": 0.010, "efficiency/decode_s_per_token/96": 0.002, "efficiency/peak_mib/96": 1.5,
        "efficiency/encode_s/96": 0.004, "efficiency/retrieval_s/96": 0.0,
        "efficiency/ttft_s/480": 0.0205, "efficiency/decode_s_per_token/480": 0.003, "efficiency/peak_mib/480": 6.0,
        "efficiency/encode_s/480": 0.02, "efficiency/retrieval_s/480": 0.0,
        "efficiency/encoder_chunks_per_s": 300.0}
    baseline = efficiency_metrics([{**row, "encoder_chunks_per_s": 0.0} for row in ROWS])  # no encoder to time
    assert "efficiency/encoder_chunks_per_s" not in baseline and len(baseline) == 10


def test_the_suite_reports_its_rows_metrics_and_line(monkeypatch):
    calls = []
    monkeypatch.setattr(efficiency, "run_efficiency", lambda settings, source, workers: calls.append(source) or ROWS)
    workers = Workers(actors=1, cpus_per_actor=1.0, use_gpu=False, tracking_uri="", out=Path("."))
    result = EfficiencyEvaluation(EfficiencySuite(memory_tokens=[96, 480]), workers).run(Source("gca", "/e", {}))
    assert result.line == "gca: ttft 96: 10.0 ms  480: 20.5 ms"
    assert result.sections == {"efficiency": ROWS} and result.metrics == efficiency_metrics(ROWS)
    assert result.counts == {} and [s.name for s in calls] == ["gca"]


def test_filler_memory_is_chunks_of_filler():
    memory = efficiency.filler_memory(100, 24)
    assert memory.shape == (4, 24) and set(memory.ravel().tolist()) <= set(FILLER)  # 100 // 24 whole chunks
    assert efficiency.filler_memory(10, 24).shape == (1, 24)  # at least one chunk
    assert np.array_equal(memory, efficiency.filler_memory(100, 24)) and not np.array_equal(
        memory, efficiency.filler_memory(100, 24, seed=1))


def test_timed_is_the_median_after_one_warm_up(monkeypatch):
    clock = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # the three timed calls take 1, 3 and 2 s
    monkeypatch.setattr(efficiency.time, "perf_counter", lambda: next(clock))
    calls = []
    seconds, result = efficiency._timed(lambda: calls.append(len(calls)) or len(calls), repeats=3)
    assert seconds == 2.0 and result == 4 and len(calls) == 4  # warm-up + 3, the last call's result


def fresh_pages(mib: int) -> mmap.mmap:
    """`mib` MiB of new anonymous pages, each written: resident whatever malloc kept from earlier tests (a numpy
    array can reuse memory an earlier test freed, and then RSS does not grow: seen once in a full run)."""
    block = mmap.mmap(-1, mib * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    return block


def test_peak_rss_sees_memory_held_inside_the_block_even_once_freed():
    with PeakRss() as held:
        block = fresh_pages(64)
    assert held.grown_mib >= 48  # still held at the end of the block
    block.close()
    with PeakRss() as freed:
        block = fresh_pages(64)
        time.sleep(0.1)  # the sampler (every ms) sees it
        block.close()
    assert freed.grown_mib >= 48
