"""Side-by-side timing shared by the benchmarks: ratios are only meaningful when both sides saw the same load."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def timed_side_by_side(fns: list[Callable[[], object]], repeats: int,
                       synchronize: Callable[[], None] | None = None) -> list[float]:
    """Median seconds of each function, run in turns (a, b, c, a, b, c, ...) after one warm-up call each, so that
    background load hits all alike. `synchronize` (e.g. torch.cuda.synchronize) runs before each clock read."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            start = time.perf_counter()
            fn()
            if synchronize is not None:
                synchronize()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]
