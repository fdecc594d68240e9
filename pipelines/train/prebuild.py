"""Builds, once at install time, the DeepSpeed C++ op that CPU training uses (its shared-memory all-reduce), so no
training run waits on a JIT build. The build is cached under ~/.cache/torch_extensions; GPU installs skip it.

torch's build lock is a bare file: a build killed midway (a cut-off session, a killed test) leaves it behind, and
every later load of the op then waits on it forever. clear_stale_build_lock waits out a live build and removes a
lock older than any build; the prebuild itself, stopped by a signal, releases its lock on the way out."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import deepspeed.ops
from deepspeed.accelerator import get_accelerator
from torch.utils.cpp_extension import _get_build_directory

# A quiet build takes ~45 s on 2 cores; ten minutes is past any real one.
STALE_LOCK_AGE_S = 600.0


def shm_comm_builder():
    """DeepSpeed's shared-memory comm op builder on a CPU install where it applies, else None."""
    if get_accelerator().device_name() != "cpu":
        return None
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def clear_stale_build_lock(name: str = "deepspeed_shm_comm", max_age_s: float = STALE_LOCK_AGE_S,
                           poll_s: float = 1.0) -> Path | None:
    """Waits while the op's build lock is younger than max_age_s (a build under way releases it), and removes it
    once older (a killed build's); returns the lock's path when it removed one."""
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return None
        if age > max_age_s:
            break
        time.sleep(poll_s)
    try:
        os.remove(lock)
    except FileNotFoundError:  # another process cleared it first
        return None
    print(f"prebuild: removed a stale build lock {lock} ({age / 60:.0f} min old, left by a killed build)")
    return lock


def exit_on_signal(signum: int, frame) -> None:
    """SIGTERM or SIGHUP (a killed `make`, a closed terminal) as SystemExit: torch then releases its build lock in
    its `finally`, instead of leaving it for the next run to wait out."""
    sys.exit(128 + signum)


def main() -> None:
    for stop in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, exit_on_signal)
    builder = shm_comm_builder()
    if builder is None:
        print("prebuild: not a CPU install with DeepSpeed's shared-memory comm op, nothing to build")
        return
    clear_stale_build_lock(builder.NAME)
    start = time.perf_counter()
    builder.load(verbose=False)
    print(f"prebuild: DeepSpeed {builder.absolute_name()} ready ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
