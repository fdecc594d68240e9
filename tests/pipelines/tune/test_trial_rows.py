"""A sweep's rows from Tune's results (pipelines.tune.sweep.trial_rows), on hand-made results: a trial counts as
finished, with its export, only when its own last report says its run holds the export. ASHA stops trials
asynchronously, so a trial can be stopped after its last evaluation, at max_steps, before its export is logged (seen
in CI): that one is stopped early, with no export to register."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from pipelines.train.configs.stage import StageConfig
from pipelines.tune.sweep import TRIAL_FINISHED, SweepConfig, best_row, trial_rows

CONFIG = {"fusion": "gca", "lora_rank": 8, "gca_layers": "upper_half", "lr": 1e-3}


def result(tmp_path, name: str, steps: int, finished: bool, loss: float, error=None) -> SimpleNamespace:
    checkpoint = tmp_path / name / "checkpoint_000001"
    (checkpoint / "export").mkdir(parents=True)  # the workers wrote the export with the checkpoint either way
    metrics = {"trial_id": name, "examples_seen": steps, "checkpoint_path": str(checkpoint), "needle_val_loss": loss,
               "time_total_s": 3.0, **({TRIAL_FINISHED: True} if finished else {})}
    return SimpleNamespace(metrics=metrics, config=CONFIG, path=str(tmp_path / name), error=error)


def test_only_a_trial_that_said_it_finished_is_finished_and_registrable(tmp_path):
    base = StageConfig()
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, max_steps=4, memories_per_step=1))
    results = [result(tmp_path, "done", 4, True, loss=2.0),
               result(tmp_path, "stopped_at_the_end", 4, False, loss=1.0),  # the better loss, but no export logged
               result(tmp_path, "stopped_at_a_rung", 2, False, loss=0.5),
               result(tmp_path, "failed", 2, False, loss=0.1, error=RuntimeError("boom"))]
    rows = {row["trial_id"]: row for row in trial_rows(results, SweepConfig().for_base(base), base)}
    assert rows["done"]["export"].endswith("checkpoint_000001/export") and not rows["done"]["stopped_early"]
    assert rows["stopped_at_the_end"]["stopped_early"] and rows["stopped_at_the_end"]["export"] is None
    assert rows["stopped_at_the_end"]["steps"] == 4
    assert rows["stopped_at_a_rung"]["stopped_early"] and rows["stopped_at_a_rung"]["export"] is None
    assert not rows["failed"]["stopped_early"] and rows["failed"]["export"] is None and rows["failed"]["error"]
    assert best_row(list(rows.values()), SweepConfig().for_base(base))["trial_id"] == "done"
