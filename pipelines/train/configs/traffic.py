"""The traffic-scene VLM job's config (jobs/traffic_vlm.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pipelines.data.traffic_scenes import QUESTION_TYPES
from pipelines.data.traffic_tokenizer import vocabulary
from pipelines.train.configs.common import (DeepSpeedSettings, JobConfig, RunSettings, ScalingSettings,
                                            TrackingSettings, TrainConfig, run_problems)

TRAFFIC_VOCAB = len(vocabulary())


@dataclass
class TrafficModelConfig:
    """The traffic-scene VLM (models/traffic_vlm.py): a SigLIP vision tower whose patch states the classic
    cross-attention decoder reads; the decoder keeps the seed's small configuration unless told otherwise."""

    # a local SigLIP checkpoint directory (safetensors); None: a random tower built from the vision_* fields
    vision_path: str | None = None
    image_size: int = 224  # pixels per side the tower reads (scenes are drawn at 224 and resized)
    patch_size: int = 16  # (image_size / patch_size)^2 vision tokens: 196 at 224 / 16
    vision_hidden_size: int = 128  # the random tower's width (the memory width the decoder projects from)
    vision_layers: int = 2  # the random tower's transformer layers
    vision_heads: int = 4  # and its attention heads
    vocab_size: int = 500  # decoder rows; the traffic tokenizer's vocabulary must fit
    hidden_size: int = 512  # the decoder's width
    intermediate_size: int = 2048  # its MLP's width
    layers: int = 4  # its layers (each reads the vision tokens through cross-attention)
    heads: int = 8  # its query heads
    kv_heads: int = 2  # its key/value heads (GQA: heads must be a multiple)
    max_positions: int = 128  # its rotary positions: the longest question and answer
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, ~30% more compute


@dataclass
class TrafficDataConfig:
    """Synthetic scenes (pipelines/data/traffic_scenes.py): training scenes rendered by Ray Data before training,
    held-out scenes (another split of the seeds) rendered by each worker for its share of the evaluation."""

    train_scenes: int = 4000  # the first N seeds of the train split; the stream cycles through them epoch after epoch
    heldout_scenes: int = 480  # the first N seeds of the held-out split: accuracy, F1, per-type accuracy
    heldout_fraction: float = 0.2  # share of seeds the split hash sends to held-out
    question_types: list[str] = field(default_factory=lambda: list(QUESTION_TYPES))  # which questions scenes ask
    pack_questions: bool = True  # a training row asks every question type about its scene at once; False: one
    # question a row, as the held-out scenes are asked (pipelines.data.traffic_batches.collate_scene_questions says why)
    shuffle_buffer: int = 512  # rows each worker shuffles locally while streaming
    grid_scenes: int = 12  # held-out scenes drawn with question, prediction and truth in the logged grid


@dataclass
class TrafficTrackingSettings(TrackingSettings):
    # the pyfunc is registered under this name (alias candidate); None: logged, not registered
    registered_model: str | None = "traffic-vlm"


@dataclass
class TrafficConfig(JobConfig):
    """One typed section per concern, as the stage jobs; train.memories_per_step counts scenes here."""

    KIND: ClassVar[str] = "traffic VLM config"

    model: TrafficModelConfig = field(default_factory=TrafficModelConfig)
    data: TrafficDataConfig = field(default_factory=TrafficDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    # the export is the whole model (vision tower, decoder, tokenizer), so only the final checkpoint writes one
    run: RunSettings = field(default_factory=lambda: RunSettings(name="traffic-vlm", export_every_checkpoint=False))
    tracking: TrafficTrackingSettings = field(default_factory=TrafficTrackingSettings)

    def problems(self) -> list[str]:
        p, m, d, t = [], self.model, self.data, self.train
        if m.vision_path and not (Path(m.vision_path).expanduser() / "config.json").is_file():
            p.append(f"model.vision_path {m.vision_path!r} holds no config.json: pass a local SigLIP checkpoint "
                     f"directory (config.json, model.safetensors), or leave it empty for the random tower")
        elif m.vision_path:
            saved = json.loads((Path(m.vision_path).expanduser() / "config.json").read_text())
            size = saved.get("vision_config", saved).get("image_size", 224)  # a whole SigLIP or its vision tower
            if size != m.image_size:
                p.append(f"model.image_size ({m.image_size}) differs from the checkpoint's image_size ({size}): "
                         f"pass --model.image_size {size}")
        if m.image_size <= 0 or m.patch_size <= 0 or m.image_size % m.patch_size:
            p.append(f"model.image_size ({m.image_size}) must be a positive multiple of model.patch_size "
                     f"({m.patch_size})")
        for name, heads in (("vision_hidden_size", "vision_heads"), ("hidden_size", "heads")):
            if getattr(m, heads) <= 0 or getattr(m, name) % getattr(m, heads):
                p.append(f"model.{name} ({getattr(m, name)}) must divide into model.{heads} ({getattr(m, heads)})")
        if m.kv_heads <= 0 or m.heads % m.kv_heads:
            p.append(f"model.heads ({m.heads}) must be a multiple of model.kv_heads ({m.kv_heads})")
        if m.vocab_size < TRAFFIC_VOCAB:
            p.append(f"model.vocab_size ({m.vocab_size}) is smaller than the traffic tokenizer's {TRAFFIC_VOCAB} "
                     f"words: use at least {TRAFFIC_VOCAB}")
        unknown = sorted(set(d.question_types) - set(QUESTION_TYPES))
        if unknown or not d.question_types:
            p.append(f"data.question_types {unknown or '(none)'}: choose from {list(QUESTION_TYPES)}")
        if not 0 < d.heldout_fraction < 1:
            p.append(f"data.heldout_fraction must be within (0, 1), got {d.heldout_fraction}")
        for name in ("train_scenes", "heldout_scenes", "shuffle_buffer"):
            if getattr(d, name) <= 0:
                p.append(f"data.{name} must be positive, got {getattr(d, name)}")
        if 0 < d.train_scenes < t.memories_per_step:
            p.append(f"data.train_scenes ({d.train_scenes}) must hold at least one step's train.memories_per_step "
                     f"({t.memories_per_step}) scenes")
        return p + run_problems(t, self.scaling, self.deepspeed, self.tracking)
