"""Side-by-side timing shared by the benchmarks: ratios are only meaningful when both sides saw the same load."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def timed_side_by_side(fns: list[Callable[[], object]], repeats: int,
                       synchronize: Callable[[], None] | None = None, block: int = 1) -> list[float]:
    """Median seconds of each function, run in turns (a, b, c, a, b, c, ...) after one warm-up call each, so that
    background load hits all alike. `synchronize` (e.g. torch.cuda.synchronize) runs before each clock read.
    `block` > 1: each turn calls a function `block` times in a row and times all but the first, so a side is timed
    with its own data in the caches, as a user running it alone has it (one call of a side that streams a large
    memory evicts what the next side's call would have found cached)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            for call in range(block):
                start = time.perf_counter()
                fn()
                if synchronize is not None:
                    synchronize()
                if call or block == 1:
                    samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]
