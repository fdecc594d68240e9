"""The dense retriever job's config (jobs/retriever.py): the dense-rag baseline's retriever, the project's own memory
encoder trained contrastively on the needle task's questions and their evidence chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from models.memory import ENCODER_ATTENTIONS
from models.specs import PAIRS
from pipelines.train.configs.common import (DeepSpeedSettings, JobConfig, RunSettings, ScalingSettings,
                                            TrackingSettings, TrainConfig, run_problems)
from pipelines.train.configs.stage import NeedleConfig


@dataclass
class RetrieverModelConfig:
    pair: str = "tiny-shared"  # the pair whose encoder the retriever starts from (the reader's pair)
    checkpoint_root: str | None = None  # where the pair's checkpoints live (tiny pairs: written there first)
    encoder_checkpoint: str | None = None  # an encoder directory replacing the pair's, e.g. a UL2 export/encoder
    attention: str = "bidirectional"  # how the encoder reads a question or a chunk: bidirectional | causal
    temperature: float = 0.01  # the contrastive loss's softmax temperature (cosine similarities / temperature)
    k: int = 2  # the held-out recall@k the evaluation reports: the chunks the dense_rag reader is given (rag_k)
    # the memory size (x the base chunks) the held-out recall is measured at. Most needle tasks keep their facts in
    # 2-4 chunks at any size, so a retriever that only tells facts from filler recalls them at k 2-4; alias_multi_key
    # (8 fact chunks at 4x) and k 1 tell that apart from a learned match
    eval_multiplier: int = 4


@dataclass
class RetrieverConfig(JobConfig):
    """One typed section per concern, as the stage jobs; train.memories_per_step counts memories, and every question
    of a micro-batch is scored against every chunk of it (its own memory's other chunks: the hard negatives)."""

    KIND: ClassVar[str] = "retriever config"

    model: RetrieverModelConfig = field(default_factory=RetrieverModelConfig)
    needle: NeedleConfig = field(default_factory=NeedleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=lambda: DeepSpeedSettings(zero_stage=2))
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    run: RunSettings = field(default_factory=lambda: RunSettings(name="retriever-tiny"))
    tracking: TrackingSettings = field(default_factory=TrackingSettings)

    def problems(self) -> list[str]:
        m, p = self.model, []
        if m.pair not in PAIRS:
            p.append(f"model.pair {m.pair!r} is not one of {sorted(PAIRS)}")
        if m.attention not in ENCODER_ATTENTIONS:
            p.append(f"model.attention must be one of {ENCODER_ATTENTIONS}, got {m.attention!r}")
        if m.temperature <= 0:
            p.append(f"model.temperature must be positive, got {m.temperature}")
        if m.k <= 0:
            p.append(f"model.k must be positive (chunks retrieved per question), got {m.k}")
        if m.eval_multiplier <= 0:
            p.append(f"model.eval_multiplier must be positive (x the base memory size), got {m.eval_multiplier}")
        if m.encoder_checkpoint and not Path(m.encoder_checkpoint).expanduser().is_dir():
            p.append(f"model.encoder_checkpoint {m.encoder_checkpoint!r} is not a directory: pass a local Qwen3 "
                     f"checkpoint (config.json, *.safetensors), or leave it empty for the pair's encoder")
        p += self.needle.problems("gca", corpus=False, num_workers=self.scaling.num_workers)
        if self.needle.base_until > 0:
            p.append("needle.base_until reads a reader's held-out accuracy, which the retriever has none of: "
                     "give the base task's steps with --needle.base_steps alone")
        return p + run_problems(self.train, self.scaling, self.deepspeed, self.tracking)
