"""The encoder-decoder UL2 job's config (jobs/encoder_ul2.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pipelines.data.ul2 import MIXTURES, Ul2DataConfig
from pipelines.train.configs.common import (DeepSpeedSettings, JobConfig, RunSettings, ScalingSettings,
                                            TrackingSettings, TrainConfig, run_problems)


@dataclass
class Ul2ModelConfig:
    checkpoint: str | None = None  # a decoder-only Qwen3 checkpoint directory; None: a tiny random one (CPU default)
    checkpoint_root: str | None = None  # where the tiny one is written; None: ~/.cache/awareness/random-checkpoints
    encoder_key_rope: str = "none"  # none (T5Gemma 2, measured better) | encoder_positions
    encoder_layers: int | None = None  # None: all of the checkpoint's layers
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, ~30% more compute


@dataclass
class Ul2Config(JobConfig):
    """One typed section per concern, as the stage jobs; train.memories_per_step counts sequences here."""

    KIND: ClassVar[str] = "UL2 config"

    model: Ul2ModelConfig = field(default_factory=Ul2ModelConfig)
    data: Ul2DataConfig = field(default_factory=Ul2DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    # its export is the whole encoder-decoder, so only the final checkpoint writes one
    run: RunSettings = field(default_factory=lambda: RunSettings(name="encoder-ul2", export_every_checkpoint=False))
    tracking: TrackingSettings = field(default_factory=TrackingSettings)

    def problems(self) -> list[str]:
        p, t = [], self.train
        if self.model.encoder_key_rope not in ("none", "encoder_positions"):
            p.append(f"model.encoder_key_rope must be none or encoder_positions, got {self.model.encoder_key_rope!r}")
        if self.model.checkpoint and not Path(self.model.checkpoint).expanduser().is_dir():
            p.append(f"model.checkpoint {self.model.checkpoint!r} is not a directory: pass a local decoder-only "
                     f"Qwen3 checkpoint (config.json, *.safetensors, tokenizer.json), or leave it empty for the tiny "
                     f"one")
        if self.data.mixture not in MIXTURES:
            p.append(f"data.mixture {self.data.mixture!r} is not one of {sorted(MIXTURES)}")
        if self.data.seq_len < 16:
            p.append(f"data.seq_len must be at least 16 tokens, got {self.data.seq_len}")
        return p + run_problems(t, self.scaling, self.deepspeed, self.tracking)
