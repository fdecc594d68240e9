"""The optimizer's parameter groups and learning-rate schedule, per recipe: transformers' warmup + cosine at every
step, the decoder group held at 0 for train.frozen_decoder_steps, and nothing else frozen (the UL2 model included)."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from models import set_trainable
from pipelines.train.configs.common import TrainConfig
from pipelines.train.configs.ul2 import Ul2Config, Ul2ModelConfig
from pipelines.train.engine import lr_scheduler
from pipelines.train.recipes.stage import STAGE
from pipelines.train.recipes.ul2 import UL2, prepare_checkpoint

T = TrainConfig(max_steps=40, lr=1e-3, min_lr_ratio=0.1, warmup_steps=5, frozen_decoder_steps=8)


def trajectory(groups: dict[str, list[torch.nn.Parameter]], t: TrainConfig) -> dict[str, list[float]]:
    """Every group's learning rate at steps 0 .. max_steps, as DeepSpeed steps the scheduler."""
    optimizer = torch.optim.AdamW([{"params": p, "name": n} for n, p in groups.items()], lr=t.lr)
    scheduler = lr_scheduler(optimizer, t)
    lrs: dict[str, list[float]] = {n: [] for n in groups}
    for _ in range(t.max_steps + 1):
        for group in optimizer.param_groups:
            lrs[group["name"]].append(group["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def transformers_trajectory(t: TrainConfig) -> list[float]:
    """transformers' schedule one step ahead (engine.cosine_factor): update k at its factor for k + 1."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.lr)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, t.warmup_steps, t.max_steps,
                                                            min_lr_rate=t.min_lr_ratio)
    lrs = []
    for _ in range(t.max_steps + 1):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs[1:] + lrs[-1:]


def test_stage_groups_follow_transformers_and_the_decoder_waits(tiny):
    set_trainable(tiny, decoder="full", encoder="full", gca="full")
    groups = STAGE.parameter_groups(tiny)
    assert set(groups) == {"gca", "decoder", "encoder"}
    lrs, want = trajectory(groups, T), transformers_trajectory(T)
    assert lrs["gca"] == pytest.approx(want) and lrs["encoder"] == pytest.approx(want)
    frozen = T.frozen_decoder_steps
    assert lrs["decoder"][:frozen] == [0.0] * frozen
    assert lrs["decoder"][frozen:] == pytest.approx(want[frozen:])
    assert want[-1] == pytest.approx(T.lr * T.min_lr_ratio)
    assert lrs["gca"][0] == pytest.approx(T.lr / T.warmup_steps)  # the first update trains


def test_ul2_parameters_are_their_own_group_and_never_wait(tmp_path):
    """frozen_decoder_steps is the stage plan's decoder warm-up; a seq2seq model has no such group, so a nonzero
    value must not freeze it (it once labelled every seq2seq parameter `decoder`)."""
    config = Ul2Config(model=Ul2ModelConfig(checkpoint_root=str(tmp_path)))
    checkpoint, _ = prepare_checkpoint(config)
    model = UL2.build_model(config, {"checkpoint": checkpoint, "start_token": 1}, {})
    groups = UL2.parameter_groups(model)
    assert list(groups) == ["seq2seq"]
    assert sum(p.numel() for p in groups["seq2seq"]) == sum(p.numel() for p in model.parameters())
    t = TrainConfig(max_steps=20, lr=1e-3, warmup_steps=0, frozen_decoder_steps=10)
    lrs = trajectory(groups, t)["seq2seq"]
    assert lrs[0] > 0.99 * t.lr  # step 0: (nearly) the full rate, nothing frozen
    assert lrs == pytest.approx(transformers_trajectory(t))
