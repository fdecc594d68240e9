"""The build lock a killed JIT build leaves behind must not hang the next install or training run (it hung CI once:
a cut-off session left ~/.cache/torch_extensions/.../lock, and CI's prebuild waited on it until its time ran out)."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from pipelines.train.prebuild import STALE_LOCK_AGE_S, clear_stale_build_lock, shm_comm_builder


def test_a_stale_lock_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "some_op").mkdir()
    lock = tmp_path / "some_op" / "lock"
    assert clear_stale_build_lock("some_op") is None  # no lock: nothing to do

    lock.touch()
    old = time.time() - STALE_LOCK_AGE_S - 60
    os.utime(lock, (old, old))  # a build killed long ago
    assert clear_stale_build_lock("some_op") == lock
    assert not lock.exists()


def test_a_live_build_is_waited_out_not_broken(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "some_op").mkdir()
    lock = tmp_path / "some_op" / "lock"
    lock.touch()  # a build running now, released after 0.3 s
    releaser = threading.Timer(0.3, lock.unlink)
    releaser.start()
    start = time.perf_counter()
    assert clear_stale_build_lock("some_op", poll_s=0.05) is None  # it returned because the build released it
    assert time.perf_counter() - start >= 0.25
    releaser.join()


def test_a_young_lock_is_removed_once_it_is_old(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "some_op").mkdir()
    lock = tmp_path / "some_op" / "lock"
    lock.touch()  # killed a moment ago: nobody will release it
    assert clear_stale_build_lock("some_op", max_age_s=0.3, poll_s=0.05) == lock
    assert not lock.exists()


def _running_compilers(pid):
    """The C++ compilers under `pid`; a child that exits between the listing and the read is not one of them."""
    compilers = []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if "cc1plus" in child.name():
                compilers.append(child)
    return compilers


def test_a_prebuild_stopped_midway_leaves_no_lock(tmp_path):
    """`make install` killed during the op's build (a SIGTERM from a stopped `make`): the build lock goes with it,
    so the next install or training run does not wait out the stale-lock age (10 min)."""
    if shm_comm_builder() is None:
        pytest.skip("not a CPU install: nothing is built")
    root = Path(__file__).resolve().parents[3]
    build = subprocess.Popen([sys.executable, "-m", "pipelines.train.prebuild"], cwd=root, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    deadline, compilers = time.monotonic() + 120, []
    while not compilers:  # a fresh cache: it must build; it holds the lock by the time the compilers run
        assert build.poll() is None and time.monotonic() < deadline, build.stdout.read().decode()[-2000:]
        compilers = _running_compilers(build.pid)
        time.sleep(0.1)
    assert list(tmp_path.glob("*/lock"))
    build.send_signal(signal.SIGTERM)
    try:
        assert build.wait(timeout=60) == 128 + signal.SIGTERM
        assert not list(tmp_path.glob("*/lock"))
    finally:
        for compiler in compilers:  # ninja gives each compiler its own session: they outlive it
            with contextlib.suppress(psutil.NoSuchProcess):
                compiler.kill()
