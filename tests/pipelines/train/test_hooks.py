"""The worker loop's one extension point (pipelines/train/hooks.py): the function $AWARENESS_TRAIN_HOOK names is the
one called, with the event and step; unset, the hook does nothing. The loop calling it at "train" and "save" on
every rank, through Ray Train: the fault-tolerance tests (tests/pipelines/train/test_stage0.py, faults.py)."""

from __future__ import annotations

import pytest

from pipelines.train.hooks import HOOK_ENV, installed_hook

CALLS: list[tuple[str, int]] = []


def record(event: str, step: int) -> None:
    CALLS.append((event, step))


def test_the_named_hook_is_called_with_event_and_step(monkeypatch):
    monkeypatch.setenv(HOOK_ENV, f"{__name__}:record")
    CALLS.clear()
    hook = installed_hook()
    assert hook is record
    hook("train", 3)
    hook("save", 4)
    assert CALLS == [("train", 3), ("save", 4)]


@pytest.mark.parametrize("value", [None, ""])
def test_without_a_hook_nothing_is_called(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(HOOK_ENV, raising=False)
    else:
        monkeypatch.setenv(HOOK_ENV, value)
    CALLS.clear()
    assert installed_hook()("train", 1) is None and CALLS == []


def test_a_hook_that_is_not_there_fails_loudly(monkeypatch):
    monkeypatch.setenv(HOOK_ENV, f"{__name__}:no_such_function")
    with pytest.raises(AttributeError):
        installed_hook()
    monkeypatch.setenv(HOOK_ENV, "no.such.module:hook")
    with pytest.raises(ModuleNotFoundError):
        installed_hook()
