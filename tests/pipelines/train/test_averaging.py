"""train.ema_decay: the average against the formula worked by hand, the trained weights back exactly after the
averaged ones were read, a checkpoint's average carried across a resume, and a stage job that exports the average
beside the last step's own weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.awareness import WEIGHTS_NAME
from pipelines.cli import ConfigError
from pipelines.tracking.checkpoints import UNAVERAGED_EXPORT_DIR
from pipelines.train.averaging import AVERAGE_FILE, WeightAverage
from pipelines.train.configs.common import DeepSpeedSettings
from tests.pipelines.train import faults
from tests.pipelines.train.test_stage0 import expected_checksum, small_config


def weights(*values: list[float]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.tensor(v)) for v in values]


def set_weights(params: list[torch.nn.Parameter], *values: list[float]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            p.copy_(torch.tensor(v))


def test_the_average_follows_the_ema_formula_from_the_first_update():
    """decay 0.5 by hand: the first update takes the weights (2), each later one halves the way to them:
    (2 + 4) / 2 = 3, then (3 + 10) / 2 = 6.5."""
    params = weights([2.0, -2.0], [1.0])
    average = WeightAverage(params, decay=0.5)
    average.update()
    set_weights(params, [4.0, 0.0], [1.0])
    average.update()
    set_weights(params, [10.0, 0.0], [5.0])
    average.update()
    assert torch.equal(average.average[0], torch.tensor([6.5, -0.5]))
    assert torch.equal(average.average[1], torch.tensor([3.0]))
    assert average.updates == 3


def test_the_averaged_weights_are_read_inside_the_block_and_the_trained_ones_come_back_exactly():
    params = weights([0.1, 0.2], [0.3])
    average = WeightAverage(params, decay=0.9)
    average.update()
    set_weights(params, [1.7, -3.1], [0.7])
    average.update()
    trained = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError), average.applied():
        for p, a in zip(params, average.average, strict=True):
            assert torch.equal(p, a)
        raise RuntimeError("an evaluation that fails")
    for p, t in zip(params, trained, strict=True):
        assert torch.equal(p, t) and p.requires_grad


def test_only_the_trained_parameters_are_averaged_and_decay_0_averages_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)
    assert WeightAverage.of_trained(model, 0.0) is None
    average = WeightAverage.of_trained(model, 0.99)
    assert [p for p in average.params] == list(model[1].parameters())


def test_a_checkpoint_carries_the_average_and_its_count(tmp_path):
    params = weights([1.0, 2.0], [3.0])
    average = WeightAverage(params, decay=0.5)
    average.update()
    set_weights(params, [3.0, 2.0], [1.0])
    average.update()
    average.save(tmp_path)
    resumed = WeightAverage(weights([9.0, 9.0], [9.0]), decay=0.5)
    resumed.load(tmp_path)
    assert resumed.updates == 2
    for a, b in zip(resumed.average, average.average, strict=True):
        assert torch.equal(a, b)
    fresh = WeightAverage(weights([9.0, 9.0], [9.0]), decay=0.5)
    fresh.load(tmp_path / "a run that did not average")  # no file: the average starts from the resumed weights
    assert fresh.updates == 0
    with pytest.raises(ValueError, match="holds 2 tensors and this model trains 1"):
        WeightAverage(weights([1.0]), decay=0.5).load(tmp_path)


def test_averaging_is_refused_where_zero3_partitions_the_weights(tmp_path, checkpoint_root):
    config = small_config(tmp_path, checkpoint_root, "ema", steps=2)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, ema_decay=0.99))
    with pytest.raises(ConfigError, match="ZeRO-3 partitions: use --deepspeed.zero_stage 0-2"):
        config.validate()
    bad = dataclasses.replace(config, train=dataclasses.replace(config.train, ema_decay=1.0),
                              deepspeed=DeepSpeedSettings(zero_stage=2))
    with pytest.raises(ConfigError, match=r"train.ema_decay must be within \[0, 1\)"):
        bad.validate()


def averaging_config(tmp_path: Path, checkpoint_root: Path, name: str, steps: int):
    config = small_config(tmp_path, checkpoint_root, name, steps=steps)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, ema_decay=0.5),
                               deepspeed=DeepSpeedSettings(zero_stage=0))


@pytest.mark.ray
def test_a_stage_job_exports_the_average_and_the_last_steps_own_weights(tmp_path, checkpoint_root, local_ray):
    """ZeRO-0 on 2 workers, 3 steps at decay 0.5: the export holds the checkpoint's average, the unaveraged export
    other weights, and the summary both evaluations."""
    from pipelines.train.recipes.jobs import train

    summary = train(averaging_config(tmp_path, checkpoint_root, "ema", steps=3))
    assert summary["error"] is None and summary["steps"] == 3
    checkpoint = Path(summary["checkpoint"])
    assert summary["export_unaveraged"] == str(checkpoint / UNAVERAGED_EXPORT_DIR)
    exported = load_file(Path(summary["export"]) / WEIGHTS_NAME)
    unaveraged = load_file(checkpoint / UNAVERAGED_EXPORT_DIR / WEIGHTS_NAME)
    average = load_file(checkpoint / AVERAGE_FILE)
    assert exported.keys() == unaveraged.keys() and len(average) == len(exported)  # every weight trains here
    for tensor in average.values():  # each averaged tensor is one the export holds
        assert any(t.shape == tensor.shape and torch.equal(t.float(), tensor) for t in exported.values())
    assert any(not torch.equal(exported[k], unaveraged[k]) for k in exported)
    assert 0 <= summary["unaveraged/needle_accuracy"] <= 1 and 0 <= summary["needle_accuracy"] <= 1


@pytest.mark.slow
@pytest.mark.ray
def test_an_averaging_run_resumes_to_the_same_average(tmp_path, checkpoint_root, local_ray, fault_plan):
    """A worker dies at step 3, the run restarts from checkpoint 2 with its average, and exports, bit for bit, the
    average of a run that never failed."""
    runs = faults.assert_resume_is_exact(lambda name: averaging_config(tmp_path, checkpoint_root, f"ema-{name}", 4),
                                         fault_plan, tmp_path, steps=4)
    for summary in runs.values():
        state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
        assert state["index_checksum"] == expected_checksum(4)
