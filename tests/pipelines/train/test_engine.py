"""pipelines/train/engine.py: the optimizer's parameter groups and learning-rate schedule, per recipe: transformers'
warmup + cosine at every step, the decoder group held at 0 for train.frozen_decoder_steps, and nothing else frozen
(the UL2 model included); the DeepSpeed config a run's settings make, and ZeRO-3 loading switched on for a build only.
ZeRO-3 builds on two ranks: test_zero3_loading.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from models import set_trainable
from pipelines.train.configs.common import DeepSpeedSettings, TrainConfig
from pipelines.train.configs.stage import StageConfig
from pipelines.train.configs.ul2 import Ul2Config, Ul2ModelConfig
from pipelines.train.engine import Schedule, Zero3Partitioner, deepspeed_config, lr_scheduler, zero3_loading
from pipelines.train.recipes.stage import STAGE
from pipelines.train.recipes.ul2 import UL2, prepare_checkpoint

T = TrainConfig(max_steps=40, lr=1e-3, min_lr_ratio=0.1, warmup_steps=5, frozen_decoder_steps=8)


def trajectory(groups: dict[str, list[torch.nn.Parameter]], t: TrainConfig,
               spans: dict[int, list[int]] | None = None) -> dict[str, list[float]]:
    """Every group's learning rate at steps 0 .. max_steps, as DeepSpeed steps the scheduler; `spans`: the
    Schedule's span from a step on, as the loop sets it from TrainState.decay before the step."""
    optimizer = torch.optim.AdamW([{"params": p, "name": n} for n, p in groups.items()], lr=t.lr)
    schedule = Schedule(t)
    scheduler = lr_scheduler(optimizer, t, schedule)
    lrs: dict[str, list[float]] = {n: [] for n in groups}
    for step in range(t.max_steps + 1):
        schedule.span = (spans or {}).get(step, schedule.span)
        for group in optimizer.param_groups:
            lrs[group["name"]].append(group["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def transformers_trajectory(t: TrainConfig) -> list[float]:
    """transformers' schedule one step ahead (engine.Schedule): update k at its factor for k + 1."""
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


def test_a_span_holds_the_peak_then_decays_over_its_steps(tiny):
    """needle.mixture_steps: until the mixture starts the span is [max_steps, max_steps] (the peak held after
    warmup); at step 12 it moves to [12, 32], and from there the rate follows transformers' cosine without warmup
    over those 20 steps, one step ahead, to the floor at the run's last update (step 31), the decoder still frozen for
    its first steps. Update 12's rate was set at the end of step 11, before the span moved: the peak. The LambdaLR's
    state holds no span: it lives in the loop's state."""
    set_trainable(tiny, decoder="full", encoder="full", gca="full")
    groups = STAGE.parameter_groups(tiny)
    t = dataclasses.replace(T, max_steps=40)
    lrs = trajectory(groups, t, spans={0: [40, 40], 12: [12, 32]})
    want = transformers_trajectory(dataclasses.replace(T, warmup_steps=0, max_steps=20))
    assert lrs["gca"][:T.warmup_steps] == pytest.approx(transformers_trajectory(t)[:T.warmup_steps])
    assert lrs["gca"][T.warmup_steps - 1:13] == pytest.approx([T.lr] * (14 - T.warmup_steps))
    assert lrs["gca"][13:32] == pytest.approx(want[1:20])  # update 13 at the cosine's factor for 2, ...
    assert lrs["gca"][31] == pytest.approx(T.lr * T.min_lr_ratio)
    assert lrs["decoder"][:T.frozen_decoder_steps] == [0.0] * T.frozen_decoder_steps
    assert lrs["decoder"][T.frozen_decoder_steps:32] == pytest.approx(lrs["gca"][T.frozen_decoder_steps:32])
    optimizer = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "name": "gca"}], lr=1.0)
    assert lr_scheduler(optimizer, t, Schedule(t)).state_dict()["lr_lambdas"] == [None]


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


def test_the_deepspeed_config_of_a_runs_settings():
    config = StageConfig(train=TrainConfig(memories_per_step=16, grad_accum=2, grad_clip=0.5),
                         deepspeed=DeepSpeedSettings(zero_stage=3, precision="bf16", offload_optimizer=True))
    ds = deepspeed_config(config, world=4)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 2  # 16 / (4 x 2)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    fp32 = deepspeed_config(StageConfig(deepspeed=DeepSpeedSettings(precision="fp32", offload_params=True)), world=1)
    assert fp32["bf16"] == {"enabled": False}
    assert fp32["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}


def test_zero3_loading_is_on_for_a_zero3_build_only():
    from transformers.integrations import is_deepspeed_zero3_enabled

    from models import UNPARTITIONED

    with zero3_loading(deepspeed_config(StageConfig(deepspeed=DeepSpeedSettings(zero_stage=2)), 1)) as partitioner:
        assert partitioner is UNPARTITIONED and not is_deepspeed_zero3_enabled()
    with zero3_loading(deepspeed_config(StageConfig(), 1)) as partitioner:  # ZeRO-3: DeepSpeedSettings' default
        assert isinstance(partitioner, Zero3Partitioner) and is_deepspeed_zero3_enabled()
    assert not is_deepspeed_zero3_enabled()  # nothing after the build sees it
