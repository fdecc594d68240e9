"""Where a running job's step time goes: a training-loop hook (pipelines.train.hooks) that records a window of the
job's steps under torch.profiler and prints the top operators by device time (CPU time on a CPU worker).

    AWARENESS_TRAIN_HOOK=pipelines.train.profiling:profile_steps AWARENESS_PROFILE_STEPS=20:25 \
        AWARENESS_PROFILE_OUT=$PWD/step-profile.txt python jobs/stage0.py --train.max_steps 30

Rank 0 records from the end of step 20 to the end of step 25: five whole steps with everything the loop does
between them (data, logging, the loss's all-reduce), which a bare step's profile (benchmarks/gpu_mfu.py --profile)
leaves out. The table goes to AWARENESS_PROFILE_OUT on rank 0's node and to the worker's output (on the console
with --run.verbose true). The environment reaches the workers of a local Ray; on a cluster, put it in the job's
runtime_env env_vars."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

STEPS_ENV, OUT_ENV = "AWARENESS_PROFILE_STEPS", "AWARENESS_PROFILE_OUT"
ROWS = 30  # operators in the table

_running: dict[str, torch.profiler.profile] = {}


def profile_steps(event: str, step: int) -> None:
    """The hook: starts the profiler after step `first`, stops it after step `last` and prints its table."""
    if event != "train" or (dist.is_initialized() and dist.get_rank() != 0):
        return
    first, last = profile_window(os.environ.get(STEPS_ENV, "20:25"))
    cuda = torch.cuda.is_available()
    if step == first:
        if cuda:
            torch.cuda.synchronize()  # the window holds whole steps: nothing of step `first` still queued
        _running["profiler"] = torch.profiler.profile(activities=activities(cuda))
        _running["profiler"].start()
    elif step == last and "profiler" in _running:
        if cuda:
            torch.cuda.synchronize()
        profiler = _running.pop("profiler")
        profiler.stop()
        text = (f"profile of steps {first + 1}-{last}, top operators by {sort_key(cuda)}:\n"
                + top_operators(profiler, cuda))
        print(text, flush=True)
        if os.environ.get(OUT_ENV):
            Path(os.environ[OUT_ENV]).write_text(text)


def profile_window(spec: str) -> tuple[int, int]:
    """"FIRST:LAST" -> (FIRST, LAST): record after step FIRST until after step LAST."""
    try:
        first, last = (int(part) for part in spec.split(":"))
    except ValueError:
        raise ValueError(f"{STEPS_ENV}={spec!r}: write FIRST:LAST, e.g. 20:25 (after step 20 until after step 25)")
    if not 0 <= first < last:
        raise ValueError(f"{STEPS_ENV}={spec!r}: FIRST must be >= 0 and below LAST, e.g. 20:25")
    return first, last


def activities(cuda: bool) -> list[torch.profiler.ProfilerActivity]:
    return [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])


def sort_key(cuda: bool) -> str:
    return "self_cuda_time_total" if cuda else "self_cpu_time_total"


def top_operators(profiler: torch.profiler.profile, cuda: bool) -> str:
    """The profile's top operators by device time (CPU time without a GPU), as torch.profiler prints them."""
    return profiler.key_averages().table(sort_by=sort_key(cuda), row_limit=ROWS, max_name_column_width=60) + "\n"
