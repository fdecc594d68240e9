"""The build lock a killed JIT build leaves behind must not hang the next install or training run (it hung CI once:
a cut-off session left ~/.cache/torch_extensions/.../lock, and CI's prebuild waited on it until its time ran out)."""

import os
import threading
import time

from pipelines.train.prebuild import STALE_LOCK_AGE_S, clear_stale_build_lock


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
