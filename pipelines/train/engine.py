"""The DeepSpeed engine a training loop drives: its config, the optimizer and schedule, ZeRO-3 details, and the
checkpoint/resume/export path every job shares (Ray Train checkpoints hold the engine's shards and the loop state)."""

from __future__ import annotations

import json
import math
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import deepspeed
import ray.train
import torch
import torch.distributed as dist
from deepspeed.utils import set_z3_leaf_modules
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from models import AwarenessModel
from models.trainable import is_added_parameter, parameter_group
from pipelines.train.config import StageConfig

ENGINE_TAG = "engine"
STATE_FILE = "trainer_state.json"
EXPORT_DIR = "export"


def quiet_known_warnings() -> None:
    """DeepSpeed 0.19 calls two torch.distributed collectives that torch 2.13 deprecates, at every step; the
    FutureWarnings would bury the log. Only those two are silenced."""
    warnings.filterwarnings(
        "ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )


def deepspeed_config(config: StageConfig, world: int) -> dict[str, Any]:
    t, ds = config.train, config.deepspeed
    bf16 = ds.precision == "bf16" or (ds.precision == "auto" and torch.cuda.is_available())
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": t.memories_per_step // (world * t.grad_accum),
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def setup_deepspeed(model: AwarenessModel, config: StageConfig):
    """A torch AdamW with one parameter group per part (GCA, decoder, encoder) and a cosine schedule, handed to
    DeepSpeed: no DeepSpeed optimizer op to JIT-build. The decoder group's learning rate stays 0 for the plan's
    warm-up phase (train.frozen_decoder_steps)."""
    groups: dict[str, list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault(parameter_group(name), []).append(param)
    t = config.train
    optimizer = torch.optim.AdamW(
        [{"params": params, "name": name} for name, params in groups.items()], lr=t.lr, weight_decay=t.weight_decay
    )
    schedules = [_lr_lambda(t, frozen=t.frozen_decoder_steps if name == "decoder" else 0) for name in groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
    if config.deepspeed.zero_stage == 3:
        mark_zero3_leaf_modules(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(config, dist.get_world_size()))
    return engine


def mark_zero3_leaf_modules(model: AwarenessModel) -> None:
    """Qwen3-MoE's sparse block runs only the experts its tokens route to, so ranks would wait on different
    parameter gathers and hang: ZeRO-3 must gather the whole block at once (a leaf module)."""
    if any(isinstance(m, Qwen3MoeSparseMoeBlock) for m in model.modules()):
        set_z3_leaf_modules(model, [Qwen3MoeSparseMoeBlock])


def _lr_lambda(t, frozen: int):
    def factor(step: int) -> float:
        if step < frozen:
            return 0.0
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def save_checkpoint(engine, state, metrics: dict[str, float], *, export: Callable[[Path], None] | None = None,
                    faults=None) -> None:
    """Every worker writes its ZeRO shard into its own directory and reports it; Ray Train registers the checkpoint
    only once every worker has reported, so one that a dying worker left incomplete is never resumed from.
    `export(directory)` (final checkpoints) adds what users load; the stage and UL2 loops share this."""
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag=ENGINE_TAG, client_state={"trainer_state": asdict(state)})
        if dist.get_rank() == 0:
            (Path(tmp) / STATE_FILE).write_text(json.dumps(asdict(state)))
        if export is not None:
            export(Path(tmp) / EXPORT_DIR)
        if faults is not None:
            faults.maybe_fail("save", state.step)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def restore_checkpoint(engine, state_cls: type):
    """Model, optimizer, scheduler and the loop's state (a `state_cls`, saved as client state "trainer_state") from
    the latest registered checkpoint, if any. The UL2 job shares it with its own state class."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return state_cls()
    with checkpoint.as_directory() as directory:
        _, client_state = engine.load_checkpoint(directory, tag=ENGINE_TAG)
    return state_cls(**client_state["trainer_state"])


def export_artifact(engine, config: StageConfig, directory: Path) -> None:
    """The small artifact (GCA, projection, LoRA, any base weight trained in full), gathered from the ZeRO-3 shards
    and written by rank 0 with AwarenessModel.save_pretrained: it reloads without DeepSpeed."""
    model: AwarenessModel = engine.module
    params = [p for n, p in model.named_parameters() if is_added_parameter(n) or p.requires_grad]
    with deepspeed.zero.GatheredParameters(params, enabled=config.deepspeed.zero_stage == 3):
        if dist.get_rank() == 0:
            model.save_pretrained(directory)
    dist.barrier()

