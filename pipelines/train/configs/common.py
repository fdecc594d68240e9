"""What every training job's config shares: the JobConfig protocol (the dict it crosses the Ray Train boundary as,
its parsing, a validation that collects every problem into one message) and the sections every job has: the
schedule, DeepSpeed, the workers, the run and its tracking."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from pipelines.cli import ConfigError, from_typed_dict, to_dict


OPTIMIZERS = ("adamw", "adamw_8bit")


class JobConfig:
    """What every training job's typed config shares: the dict it crosses the Ray Train boundary as, its parsing,
    and a validation that raises every problem at once (each subclass lists its own in `problems`)."""

    KIND: ClassVar[str] = "config"

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        return from_typed_dict(cls, data)

    def problems(self) -> list[str]:
        raise NotImplementedError

    def validate(self):
        problems = self.problems()
        if problems:
            raise ConfigError(f"invalid {self.KIND}:\n  - " + "\n  - ".join(problems))
        return self


def run_problems(t: "TrainConfig", scaling: "ScalingSettings", deepspeed: "DeepSpeedSettings",
                 tracking: "TrackingSettings") -> list[str]:
    """The checks of the sections every training job has: the schedule, the workers, DeepSpeed, tracking."""
    p = tracking.problems() + [f"train.{name} must be positive, got {getattr(t, name)}" for name in
         ("max_steps", "memories_per_step", "grad_accum", "log_every", "eval_every", "checkpoint_every")
         if getattr(t, name) <= 0]
    if t.optimizer not in OPTIMIZERS:
        p.append(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {t.optimizer!r}")
    elif t.optimizer != "adamw" and deepspeed.offload_optimizer:
        p.append(f"train.optimizer {t.optimizer} shrinks the optimizer states on the GPU, and "
                 f"deepspeed.offload_optimizer moves them to CPU memory: use one of the two")
    if t.lr <= 0 or not 0 <= t.min_lr_ratio <= 1:
        p.append("train.lr must be positive and train.min_lr_ratio within [0, 1]")
    if not 0 <= t.ema_decay < 1:
        p.append(f"train.ema_decay must be within [0, 1), e.g. 0.999 (0: no average), got {t.ema_decay}")
    elif t.ema_decay and deepspeed.zero_stage in (None, 3):
        p.append("train.ema_decay averages whole parameters, which ZeRO-3 partitions: use --deepspeed.zero_stage 0-2, "
                 "or --train.ema_decay 0")
    if scaling.num_workers <= 0:
        p.append("scaling.num_workers must be positive")
    elif t.memories_per_step % (scaling.num_workers * t.grad_accum):
        p.append(f"train.memories_per_step ({t.memories_per_step}) must divide evenly over scaling.num_workers "
                 f"({scaling.num_workers}) x train.grad_accum ({t.grad_accum})")
    if deepspeed.zero_stage not in (None, 0, 1, 2, 3):
        p.append(f"deepspeed.zero_stage must be 0-3, or none for the memory plan's choice, got {deepspeed.zero_stage}")
    if deepspeed.precision not in ("auto", "bf16", "fp32"):
        p.append(f"deepspeed.precision must be auto, bf16 or fp32, got {deepspeed.precision!r}")
    bf16 = deepspeed.precision == "bf16" or (deepspeed.precision == "auto" and scaling.use_gpu)
    if bf16 and deepspeed.zero_stage == 0:
        # DeepSpeed's bf16 without ZeRO wraps the optimizer in FP16_UnfusedOptimizer (fp32 masters, bf16 gradients):
        # 0.08 nats behind fp32 after 20 stage-0 steps, where ZeRO-2 and ZeRO-3 stay within 0.004
        # (tests/pipelines/train/test_bf16.py); the cause is not established
        p.append("deepspeed.precision bf16 needs deepspeed.zero_stage 1-3 (at stage 0 DeepSpeed's bf16 optimizer "
                 "wrapper trails fp32: docs/testing.md, bf16); use --deepspeed.zero_stage 2, or precision fp32")
    if deepspeed.offload_params and deepspeed.zero_stage not in (None, 3):
        p.append("deepspeed.offload_params needs deepspeed.zero_stage 3")
    return p


@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps; the schedule's length
    memories_per_step: int = 16  # global batch, in memories (each carries needle.questions questions)
    grad_accum: int = 1  # micro-batches per optimizer step (memories_per_step is split over workers and these)
    lr: float = 2e-4  # peak learning rate (AdamW), reached after warmup_steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30  # linear warm-up from 0 to lr
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    # evaluations and exports read an exponential moving average of the trained weights (pipelines/train/averaging.py)
    # over about the last 1 / (1 - ema_decay) steps; 0: the last step's weights. ZeRO 0-2 (whole parameters)
    ema_decay: float = 0.0
    grad_clip: float = 1.0  # gradient norm clipped to this (0: no clipping)
    frozen_decoder_steps: int = 0  # the plan's warm-up phase: decoder updates start after this many steps
    log_every: int = 20  # steps between progress lines and logged metrics
    eval_every: int = 200  # steps between validation evaluations (and one at the end)
    checkpoint_every: int = 200  # steps between checkpoints (and one at the end); a resumed run starts from the last
    seed: int = 0  # new modules' initialisation and a corpus's shuffle (needle memories come from needle.seed)
    # adamw (torch's) | adamw_8bit (bitsandbytes' AdamW8bit: both moments in 8 bits, blockwise-quantized; 2 bytes
    # per trained parameter instead of 8), handed to DeepSpeed as its client optimizer either way
    optimizer: str = "adamw"


@dataclass
class DeepSpeedSettings:
    # ZeRO stage: 3 partitions parameters, gradients and optimizer states; 2 all but parameters. None (stage jobs'
    # default): on GPUs the memory plan's choice, 2 where the whole pair fits each GPU, else 3; on CPU workers 3
    zero_stage: int | None = 3
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (GPU clusters)
    offload_params: bool = False  # ZeRO-3 parameter offload to CPU (GPU clusters)

    @property
    def stage(self) -> int:
        """The stage a run uses: zero_stage, or 3 where none was chosen (the stage recipe's prepare chooses for GPU
        runs; a config that skipped it runs as CPU workers do)."""
        return 3 if self.zero_stage is None else self.zero_stage


@dataclass
class ScalingSettings:
    num_workers: int = 2  # Ray Train workers (one per GPU on a GPU cluster)
    use_gpu: bool = False  # one GPU per worker, NCCL and bf16 (deepspeed.precision auto)
    cpus_per_worker: float = 1.0  # CPUs Ray reserves for each worker
    gpus_per_node: int = 8  # for the memory plan a GPU run checks first
    gpu_memory_gib: float = 80.0  # each GPU's memory, for the memory plan a GPU run checks first


@dataclass
class RunSettings:
    name: str = "awareness-stage0"  # a rerun with the same name and storage_path resumes
    storage_path: str = "outputs/ray"  # relative paths are made absolute on the driver
    max_failures: int = 2  # worker failures survived by restarting from the last checkpoint
    keep_checkpoints: int = 2  # the newest checkpoints Ray Train keeps on storage_path (older ones are deleted)
    export_every_checkpoint: bool = True  # every checkpoint carries export/ (register.py --step); false: the final one
    verbose: bool = False  # the workers' and Ray's own output (report dicts, progress bars) on the console too


@dataclass
class TrackingSettings:
    enabled: bool = True  # log params, metrics, plots, checkpoints and the export to MLflow
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory
    experiment: str = "awareness"  # the MLflow experiment the run is logged under

    def problems(self) -> list[str]:
        """MLflow 3 refuses its file store (`file:` or a bare directory) unless MLFLOW_ALLOW_FILE_STORE is set: said
        before any cluster time, not as a traceback from the driver's first MLflow call."""
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("1", "true")
        if not self.enabled or not uri or allowed or not uri.startswith(("file:", "/", ".", "~")):
            return []  # a database, a server, databricks: MLflow's own
        return [f"tracking.tracking_uri {uri!r} is MLflow's file store, which MLflow refuses: use a database, e.g. "
                f"sqlite:///{uri.removeprefix('file://').rstrip('/')}/mlflow.db, or an http:// server"]
