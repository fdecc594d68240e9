"""The DeepSpeed engine the training loop drives: its config, the optimizer and schedule, ZeRO-3 details, and the
checkpoint/resume path every recipe shares (Ray Train checkpoints hold the engine's shards and the loop state)."""

from __future__ import annotations

import json
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import bitsandbytes as bnb
import deepspeed
import ray.train
import torch
import torch.distributed as dist
from deepspeed.utils import set_z3_leaf_modules
from transformers import get_cosine_with_min_lr_schedule_with_warmup
from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from models import UNPARTITIONED, AwarenessModel, Partitioner
from models.quantization import is_quantized
from pipelines.train.averaging import WeightAverage
from pipelines.train.configs.common import TrainConfig
from pipelines.train.configs.stage import StageConfig
from pipelines.train.configs.ul2 import Ul2Config
from pipelines.train.prebuild import clear_stale_build_lock

ENGINE_TAG = "engine"
STATE_FILE = "trainer_state.json"


def quiet_known_warnings() -> None:
    """DeepSpeed 0.19 calls two torch.distributed collectives that torch 2.13 deprecates, at every step; the
    FutureWarnings would bury the log. Only those two are silenced."""
    warnings.filterwarnings(
        "ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )


def deepspeed_config(config: StageConfig | Ul2Config, world: int) -> dict[str, Any]:
    t, ds = config.train, config.deepspeed
    bf16 = ds.precision == "bf16" or (ds.precision == "auto" and torch.cuda.is_available())
    zero: dict[str, Any] = {"stage": ds.stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    untested = {"zero_allow_untested_optimizer": True} if t.optimizer != "adamw" else {}  # DeepSpeed lists torch's
    return {
        **untested,
        "train_micro_batch_size_per_gpu": t.memories_per_step // (world * t.grad_accum),
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class Zero3Partitioner:
    """models.Partitioner for DeepSpeed ZeRO-3: modules are created inside zero.Init with the engine's config, and
    writes to gathered parameters keep rank 0's values (every rank computes the same ones)."""

    def __init__(self, ds_config: dict[str, Any]):
        self.ds_config = ds_config

    def creating(self):
        return deepspeed.zero.Init(config_dict_or_path=self.ds_config)

    def gathered(self, params: Iterable[torch.nn.Parameter]):
        return deepspeed.zero.GatheredParameters(list(params), modifier_rank=0)


@contextmanager
def zero3_loading(ds_config: dict[str, Any]) -> Iterator[Partitioner]:
    """Under ZeRO-3, the partitioner a model build uses, with transformers' DeepSpeed integration on meanwhile:
    `from_pretrained` then builds inside zero.Init and copies each checkpoint tensor into its partitions (rank 0
    reads, one module's parameters gathered at a time), so no rank holds the whole model. transformers keeps only a
    weak reference to the HfDeepSpeedConfig, so it lives here for the build; it is dropped after, so nothing else
    (generate's synced GPUs, resizing, saving) changes. `ds_config` must be the dict deepspeed.initialize gets.
    Other stages: UNPARTITIONED, nothing on."""
    if ds_config["zero_optimization"]["stage"] != 3:
        yield UNPARTITIONED
        return
    hf_config = HfDeepSpeedConfig(ds_config)
    try:
        yield Zero3Partitioner(ds_config)
    finally:
        unset_hf_deepspeed_config()
        del hf_config


def setup_deepspeed(model: torch.nn.Module, config, groups: dict[str, list[torch.nn.Parameter]],
                    ds_config: dict[str, Any], schedule: Schedule | None = None):
    """A torch AdamW over the recipe's parameter groups and transformers' warmup + cosine schedule (`schedule`, the
    loop's, which a recipe may move), handed to DeepSpeed: no DeepSpeed optimizer op to JIT-build. `ds_config` is
    deepspeed_config(config, world), the dict the model was built with (zero3_loading). Reads only config.train and
    config.deepspeed."""
    t = config.train
    optimizer = build_optimizer([{"params": params, "name": name} for name, params in groups.items()], t)
    scheduler = lr_scheduler(optimizer, t, schedule)
    if config.deepspeed.stage == 3:
        mark_zero3_leaf_modules(model)
    clear_stale_build_lock()  # initialize loads DeepSpeed's CPU comm op; a killed build's lock would hang it
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine


def build_optimizer(groups: list[dict[str, Any]], t: TrainConfig) -> torch.optim.Optimizer:
    """train.optimizer over the parameter groups: torch's AdamW, or bitsandbytes' AdamW8bit (its moments in 8 bits,
    blockwise-quantized; DeepSpeed steps it on the fp32 partitions it hands any client optimizer, and checkpoints its
    state dict, quantization constants and all, with the engine's)."""
    if t.optimizer == "adamw_8bit":
        return bnb.optim.AdamW8bit(groups, lr=t.lr, weight_decay=t.weight_decay)
    # fused: the whole update in one kernel, on CPU as on CUDA; torch's default on CPU steps each tensor in a Python
    # loop, a cost a small model's step notices
    return torch.optim.AdamW(groups, lr=t.lr, weight_decay=t.weight_decay, fused=True)


def lr_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig,
                 schedule: Schedule | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """`schedule` (transformers' warmup + cosine to lr * min_lr_ratio) for every group, except that the decoder
    group's learning rate stays 0 for the plan's warm-up phase (train.frozen_decoder_steps)."""
    schedule = schedule or Schedule(t)

    def factor(step: int) -> float:  # a function, not the Schedule: LambdaLR checkpoints an object's attributes,
        return schedule(step)  # and the span lives in the loop's state

    factors = [frozen_for(t.frozen_decoder_steps, factor) if group["name"] == "decoder" else factor
               for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


class Schedule:
    """transformers' warmup + cosine schedule (its public constructor, read off a one-weight optimizer) as a
    function of the step, read one step ahead: its factor at step 0 is 0, so the first update would only warm Adam's
    moments. Update k trains at transformers' factor for k + 1 (lr / warmup first, the floor on the last update). The
    stage-0 demo moved with it: 0.84 needle accuracy with transformers' step 0 at LR 0, 0.95 with this (docs/jobs.md,
    stage 0).

    The cosine spans the run (warmup to train.max_steps) unless `span` is set to [first, last]: then the rate stays
    at its peak after warmup until `first` and decays from there to the floor at `last` (a stage-0 run whose needle
    mixture starts when the lookup forms, needle.mixture_steps: TrainState.decay)."""

    def __init__(self, t: TrainConfig):
        self.t, self.span = t, None
        self.whole = self.cosine(t.warmup_steps, t.max_steps)
        self.spans: dict[tuple[int, int], Callable[[int], float]] = {}

    def cosine(self, warmup: int, steps: int) -> Callable[[int], float]:
        probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        return get_cosine_with_min_lr_schedule_with_warmup(probe, warmup, steps,
                                                           min_lr_rate=self.t.min_lr_ratio).lr_lambdas[0]

    def __call__(self, step: int) -> float:
        ahead = step + 1
        if self.span is None:
            return self.whole(min(ahead, self.t.max_steps))
        first, last = self.span
        warming = self.whole(ahead) if ahead < self.t.warmup_steps else 1.0
        if ahead <= first:
            return warming
        if (first, last) not in self.spans:
            self.spans[first, last] = self.cosine(0, last - first)
        return min(warming, self.spans[first, last](min(ahead, last) - first))


def frozen_for(steps: int, factor: Callable[[int], float]) -> Callable[[int], float]:
    return lambda step: 0.0 if step < steps else factor(step)


def mark_zero3_leaf_modules(model: AwarenessModel) -> None:
    """Qwen3-MoE's sparse block runs only the experts its tokens route to, so ranks would wait on different
    parameter gathers and hang: ZeRO-3 must gather the whole block at once (a leaf module)."""
    if any(isinstance(m, Qwen3MoeSparseMoeBlock) for m in model.modules()):
        set_z3_leaf_modules(model, [Qwen3MoeSparseMoeBlock])


def save_checkpoint(engine, state, metrics: dict[str, float], *, write: Callable[[Path], None] | None = None,
                    before_report: Callable[[], None] | None = None) -> None:
    """Every worker writes its ZeRO shard into its own directory and reports it; Ray Train registers the checkpoint
    only once every worker has reported, so one that a dying worker left incomplete is never resumed from.
    `write(directory)` adds what the checkpoint carries besides the engine's shards (what users load, EXPORT_DIR;
    the weight average);
    `before_report()` runs once the checkpoint is whole on this worker and before it is reported."""
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag=ENGINE_TAG, client_state={"trainer_state": asdict(state)})
        if dist.get_rank() == 0:
            (Path(tmp) / STATE_FILE).write_text(json.dumps(asdict(state)))
        if write is not None:
            write(Path(tmp))
        if before_report is not None:
            before_report()
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def restore_checkpoint(engine, state_cls: type, average: WeightAverage | None = None):
    """Model, optimizer, scheduler, the weight average and the loop's state (a `state_cls`, saved as client state
    "trainer_state") from the latest registered checkpoint, if any."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return state_cls()
    with checkpoint.as_directory() as directory:
        # a 4-bit base's state dict holds bitsandbytes' quantization state (absmax, quant_map, ...) beside each packed
        # weight, which a strict load refuses as unexpected; those frozen weights come from the base checkpoint
        # anyway, loaded and quantized again, and what trains is checked by the resume tests
        strict = not is_quantized(engine.module)
        _, client_state = engine.load_checkpoint(directory, tag=ENGINE_TAG, load_module_strict=strict)
        if average is not None:
            average.load(Path(directory))
    return state_cls(**client_state["trainer_state"])
