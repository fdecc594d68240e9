"""The profiling hook (pipelines/train/profiling.py): through $AWARENESS_TRAIN_HOOK it records the steps its window
names, whole, and prints and writes torch.profiler's top operators."""

from __future__ import annotations

import pytest
import torch

from pipelines.train.hooks import HOOK_ENV, installed_hook
from pipelines.train.profiling import OUT_ENV, STEPS_ENV, profile_window


def test_the_hook_profiles_the_steps_of_its_window_and_no_others(monkeypatch, tmp_path, capsys):
    out = tmp_path / "profile.txt"
    monkeypatch.setenv(HOOK_ENV, "pipelines.train.profiling:profile_steps")
    monkeypatch.setenv(STEPS_ENV, "2:4")
    monkeypatch.setenv(OUT_ENV, str(out))
    hook, x = installed_hook(), torch.randn(64, 64)
    ops = {1: lambda: x.sum(), 2: lambda: x @ x, 3: lambda: x @ x, 4: lambda: torch.cumsum(x, 0)}
    for step in range(1, 6):
        hook("save", step)  # only "train" events count
        ops.get(step, lambda: None)()  # step `step`'s work, then the loop's hook call for it
        hook("train", step)
    text = out.read_text()
    assert text.startswith("profile of steps 3-4, top operators by self_cpu_time_total:")
    assert "aten::mm" in text and "aten::cumsum" in text  # steps 3 and 4: between the hooks for steps 2 and 4
    assert "aten::sum" not in text  # step 1, before the window
    assert text in capsys.readouterr().out


@pytest.mark.parametrize("spec", ["20", "5:3", "a:b", "-1:2"])
def test_a_bad_window_is_refused_with_the_form_it_takes(spec):
    with pytest.raises(ValueError, match=f"{STEPS_ENV}=.*e.g. 20:25"):
        profile_window(spec)
