"""The stage jobs' config (jobs/stage0.py, stage1.py, stage2.py, and the sweep's trials): the pair and how
it reads its memory, stage 0's synthetic needles and corpus shards (stage 4 adds its distillation:
pipelines.train.configs.stage4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from models.placement import resolve_gca_layers
from models.reading import NAME_PREFIX, MemoryReading
from models.specs import (ATTENTION, EXPERTS, FUSIONS, GROUP_TARGETS, MLP, PAIRS, QUANTIZE, TRAIN_MODES, Fusion,
                          TrainMode)
from pipelines.cli import inline
from pipelines.data.memory_modes import MemoryKind, MemoryMode
from pipelines.data.synthetic_needles import NeedleSpec
from pipelines.train.configs.common import (DeepSpeedSettings, JobConfig, RunSettings, ScalingSettings,
                                            TrackingSettings, TrainConfig, run_problems)


@dataclass
class ModelConfig:
    pair: str = "tiny"  # a name from models.PAIRS
    checkpoint_root: str | None = None  # where real pairs' checkpoints live; None: $AWARENESS_CHECKPOINT_ROOT
    gca_layers: str = "upper_third"  # placement spec (see models.placement)
    encoder_attention: str | None = None  # causal | bidirectional; None: the pair's default
    # How the decoder reads the memory (models/fusion.py): gca (gated blocks in gca_layers), cross (a cross-attention
    # in every layer, o_proj at 0, trained as the gca group) or merged (every layer's own attention reads it too;
    # nothing added but the projection: it learns through the decoder). gca_layers, gca_mlp and gca_gate_init: gca only
    fusion: Fusion = "gca"
    gca_mlp: bool = False  # a gated MLP after each cross-attention
    gca_gate_init: float = 0.0  # gates start closed (Flamingo), so a pretrained decoder starts unchanged (gca only)
    # Chunk routing and the length-aware scale (models/reading.py): flags --model.memory_top_k, memory_summaries, ...
    reading: MemoryReading = inline(MemoryReading, NAME_PREFIX)
    # With routing: the routing loss also trains the memory projection and a trained encoder (what the chunk summaries
    # are made of), not the routers alone, so the encoder learns to summarise a chunk's keys for its router
    memory_routing_grad: bool = False
    decoder: TrainMode = "lora"  # how the decoder trains (lora: lora_rank, lora_targets)
    encoder: TrainMode = "frozen"  # how the encoder trains (lora: encoder_lora_rank)
    gca: TrainMode = "full"  # how the GCA blocks (and the projection) train (lora: gca_lora_rank)
    lora_rank: int = 16  # decoder LoRA rank
    lora_alpha: float | None = None  # None: 2 * rank
    # decoder projections that get LoRA; MoE pairs: add `experts`
    lora_targets: list[str] = field(default_factory=lambda: [*ATTENTION, *MLP])
    encoder_lora_rank: int = 8  # encoder LoRA rank, when encoder=lora
    gca_lora_rank: int = 8  # GCA LoRA rank, when gca=lora
    encoder_grad_scale: float = 1.0  # multiply the gradient reaching the encoder (the plan suggests 10 when weak)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, ~30% more compute
    # regional torch.compile of the decoder, GCA and encoder layers (AwarenessModel.compile_layers); none: off
    # (on a GPU it added nothing to Liger's kernels: pipelines.train.recipes.stage.compiles_layers)
    compile: bool | None = None
    # Liger-Kernel's fused RMSNorm, SwiGLU and RoPE (models/kernels.py; the CUDA lock has it); none: on GPU
    # workers where it is installed
    liger: bool | None = None
    encoder_checkpoint: str | None = None  # e.g. jobs/encoder_ul2.py's export/encoder: replaces the pair's encoder
    init_from: str | None = None  # a previous stage's export/ (GCA, projection, LoRA) to start from, e.g. stage 1's
    # How the memory reaches the decoder: gca (the encoder + GCA blocks), or a baseline trained on the same data:
    # in_context (its chunks in the prompt: long context), rag (the top rag_k chunks by BM25, queried by the prompt, in
    # the prompt), dense_rag (the top rag_k chunks by a retriever export, jobs/retriever.py), none (the decoder
    # alone). Baselines train only the decoder; the GCA blocks and encoder stay unused,
    # and so do the memory_* reading options (routing, the logn scale): a baseline's model is built without them, as
    # is fusion merged's (its one softmax holds the decoder's own tokens too: nothing to route or scale apart).
    memory: MemoryKind = "gca"
    context_budget: int = 4096  # memory tokens a prompt may hold (in_context, rag, dense_rag); whole chunks, in
    # memory order
    rag_k: int = 2  # chunks retrieved per question (rag, dense_rag)
    retriever: str | None = None  # dense_rag: the retriever export it reads with (jobs/retriever.py's export)
    # rag, dense_rag: an iterative rag, which retrieves rag_k chunks again at each key its answer names and reads on
    # with them in its prompt too; trained on the chunks it would hold having named each key right (the answer's)
    rag_reread: bool = False
    # The frozen decoder and encoder in fewer bits (QLoRA, models/quantization.py): nf4 (4-bit NormalFloat, double
    # quantization) | int8 (LLM.int8) | none. What trains (LoRA, the GCA blocks, routers, the projection) stays in
    # full precision, so a quantized base trains with decoder and encoder lora or frozen
    quantize: str = "none"

    def memory_mode(self) -> MemoryMode:
        return MemoryMode(self.memory, context_budget=self.context_budget, rag_k=self.rag_k, retriever=self.retriever,
                          reread=self.rag_reread)

    def problems(self) -> list[str]:
        """The model section's problems: the pair, placement, train modes, fusion, routing, LoRA, start points."""
        p: list[str] = []
        m = self
        if m.pair not in PAIRS:
            p.append(f"model.pair {m.pair!r} is not one of {sorted(PAIRS)}")
        else:
            depth = PAIRS[m.pair].decoder_config["num_hidden_layers"]
            try:
                resolve_gca_layers(m.gca_layers, depth)
            except ValueError as e:
                p.append(f"model.gca_layers: {e}")
        for name in ("decoder", "encoder", "gca"):
            if getattr(m, name) not in TRAIN_MODES:
                p.append(f"model.{name} must be one of {TRAIN_MODES}, got {getattr(m, name)!r}")
        if m.fusion not in FUSIONS:
            p.append(f"model.fusion must be one of {FUSIONS}, got {m.fusion!r}")
        elif m.fusion != "gca":
            if m.memory != "gca":
                p.append(f"model.fusion {m.fusion} reads the encoder's memory, and model.memory {m.memory} is a "
                         f"baseline that puts the memory in the prompt (or leaves it out): use model.fusion gca with a "
                         f"baseline")
            if m.gca_mlp:
                p.append(f"model.gca_mlp adds gated MLPs to GCA blocks; model.fusion {m.fusion} has none: drop it")
            if m.fusion == "merged" and m.gca == "lora":
                p.append("model.gca lora puts LoRA on GCA/cross-attention blocks; model.fusion merged has none: use "
                         "model.gca full (the projection) and model.decoder lora")
            if m.fusion == "merged" and m.decoder == "frozen":
                p.append("model.fusion merged adds no attention weights (the decoder's own attention reads the "
                         "memory): train the decoder with model.decoder lora or full")
        p += m.reading.problems(prefix="model." + NAME_PREFIX)
        if m.memory_routing_grad and not m.reading.top_k:
            p.append("model.memory_routing_grad trains the chunk summaries of routing: set model.memory_top_k too "
                     "(e.g. --model.memory_top_k 4), or leave it false")
        if m.encoder_attention not in (None, "causal", "bidirectional"):
            p.append(f"model.encoder_attention must be causal or bidirectional, got {m.encoder_attention!r}")
        targets = m.lora_targets
        unknown = set(targets) - set(GROUP_TARGETS["decoder"])
        if unknown:
            p.append(f"model.lora_targets has unknown names {sorted(unknown)}; choose from {GROUP_TARGETS['decoder']}")
        if EXPERTS in targets and m.pair in PAIRS and PAIRS[m.pair].decoder_config["model_type"] != "qwen3_moe":
            p.append(f"model.lora_targets: {EXPERTS!r} is LoRA on Qwen3-MoE experts, and pair {m.pair!r} is dense: "
                     f"target its MLP with {' '.join(MLP)}")
        for name in ("lora_rank", "encoder_lora_rank", "gca_lora_rank"):
            if getattr(m, name) <= 0:
                p.append(f"model.{name} must be positive")
        if m.encoder_checkpoint and not (Path(m.encoder_checkpoint) / "config.json").is_file():
            p.append(f"model.encoder_checkpoint {m.encoder_checkpoint} holds no config.json: pass the export/encoder "
                     f"directory of a jobs/encoder_ul2.py run (or any Qwen3 checkpoint directory)")
        if m.init_from and not (Path(m.init_from) / "awareness.safetensors").is_file():
            p.append(f"model.init_from {m.init_from} holds no awareness.safetensors: pass a finished stage's "
                     f"export directory (the `export` path in its summary line)")
        p += m.memory_mode().problems()
        p += m.quantize_problems()
        return p

    def quantize_problems(self) -> list[str]:
        """A quantized base cannot train its own weights, and something else must train."""
        m = self
        if m.quantize not in QUANTIZE:
            return [f"model.quantize must be one of {', '.join(QUANTIZE)}, got {m.quantize!r}"]
        if m.quantize == "none":
            return []
        p = [f"model.{part} full trains the {part}'s own weights, and model.quantize {m.quantize} freezes them in "
             f"fewer bits: use model.{part} lora (QLoRA) or frozen, or model.quantize none"
             for part in ("decoder", "encoder") if getattr(m, part) == "full"]
        if m.memory != "gca" and m.decoder == "frozen":
            p.append(f"model.memory {m.memory} trains only the decoder, and model.quantize {m.quantize} freezes it: "
                     f"use model.decoder lora")
        return p


@dataclass
class NeedleConfig:
    """Stage 0's embedded synthetic task (used when data.train_path is not set)."""

    facts: int = 8  # key -> value facts per memory (at the base size)
    questions: int = 8  # facts asked per memory (<= facts); each GCA question is a decoder row of its own
    value_digits: int = 3  # tokens per value
    value_range: int = 10  # distinct tokens per value position (10: decimal digits; at most 90)
    chunk_len: int = 24  # tokens per memory chunk; facts are packed into fact-sized slots
    distractors: int = 2  # chunks of filler per memory (at the base size)
    # Training for size and for similar facts; each is off by default, leaving the base task.
    key_tokens: int = 1  # tokens per key (1 or 2); with 2, a hard distractor's key shares all but one token with
    # an asked key
    hard_distractors: float = 0.0  # share (0-1) of a memory's free fact slots filled with facts near-identical
    # to the asked ones (value one digit off, key one token off) instead of filler
    memory_scale_max: int = 1  # each training micro-batch's memories hold 1x..this many times the base chunks, one
    # size drawn per micro-batch from the seed (each doubling as likely)
    variants: list[str] = field(default_factory=lambda: ["single"])  # training mixture of the evaluation's tasks,
    # NAME or NAME:WEIGHT: single multi_key multi_value multi_query variable_tracking alias alias_multi_key two_hop
    # (synthetic_needles.TRAINED_VARIANTS; three_hop is scored only)
    hops: list[int] = field(default_factory=lambda: [2, 3])  # variable_tracking chain lengths, one drawn per memory
    questions_per_row: int = 4  # in_context training rows: questions asked after one copy of the memory; fewer
    # than facts, so no answer follows by elimination (the evaluation asks one a row)
    base_steps: int = 0  # the first N steps ask the base task alone (single, 1x, no hard distractors) before the
    # mixture, sizes and hard distractors start: the lookup forms there first
    base_until: float = 0.0  # with base_steps, the mixture starts earlier, at the first check (every
    # base_check_every steps) where the base task's held-out accuracy reaches this: when the lookup forms varies
    # from run to run, so a fixed switch starts some runs' mixture on the plateau (0: at base_steps)
    base_check_every: int = 100  # steps between base_until's checks
    mixture_steps: int = 0  # with base_until, the run ends this many steps after the mixture starts, its learning
    # rate at its peak until then and decaying over these steps, so every run trains the mixture as long whenever
    # its lookup forms (train.max_steps, at least base_steps + mixture_steps, is the most it may take); 0: the run
    # ends at train.max_steps, one cosine over it
    value_order: str = "memory"  # multi_value's trained answer: its two values in memory order, or "sorted" by
    # their digits (a reader that sees chunks apart, as gca does, cannot tell memory order; scoring takes either)
    # share (0-1) of a multi_value training memory's asked keys given one value, not two: whether an answer ends
    # after one value is then told by the key's facts in the memory, not by which task the memory is (the
    # evaluation's multi_value, in training and jobs/evaluate.py, asks two-valued keys only)
    one_value_share: float = 0.0
    val_memories: int = 64  # held-out memories for needle accuracy
    seed: int = 1234  # training memories come from (seed, index); validation from (seed + 1, index)

    def spec(self) -> NeedleSpec:
        return NeedleSpec(facts=self.facts, questions=self.questions, value_digits=self.value_digits,
                          value_range=self.value_range, chunk_len=self.chunk_len, distractors=self.distractors,
                          key_tokens=self.key_tokens, hard_distractors=self.hard_distractors,
                          memory_scale_max=self.memory_scale_max, variants=tuple(self.variants), hops=tuple(self.hops),
                          questions_per_row=self.questions_per_row, base_steps=self.base_steps,
                          value_order=self.value_order, one_value_share=self.one_value_share)

    def problems(self, memory: str, *, corpus: bool, num_workers: int) -> list[str]:
        """The needle section's problems for a run reading its memory as `memory` (corpus: on shards, not needles)."""
        p = [f"needle: {q}" for q in self.spec().problems()]
        n = self
        if memory == "in_context" and not corpus and 1 < n.facts <= min(n.questions_per_row, n.questions):
            p.append(f"needle.questions_per_row ({n.questions_per_row}) asks all {n.facts} facts of a memory in one "
                     f"in_context row, so its last answer follows by elimination: use --needle.questions_per_row "
                     f"{max(1, n.facts // 2)} (or ask fewer --needle.questions)")
        if not 0 <= n.base_until <= 1:
            p.append(f"needle.base_until must be an accuracy in [0, 1], got {n.base_until}")
        elif n.base_until > 0 and n.base_steps == 0:
            p.append("needle.base_until ends the base task's steps early, and there are none: give the most with "
                     "--needle.base_steps, e.g. 4000")
        if n.mixture_steps < 0:
            p.append(f"needle.mixture_steps must be >= 0, got {n.mixture_steps}")
        elif n.mixture_steps and n.base_until <= 0:
            p.append("needle.mixture_steps counts the mixture's steps from where needle.base_until starts it, and "
                     "base_until is off: give it too, e.g. --needle.base_until 0.75 --needle.base_steps 4000")
        if n.base_check_every < 1:
            p.append(f"needle.base_check_every must be >= 1, got {n.base_check_every}")
        if self.val_memories % num_workers:
            p.append(f"needle.val_memories ({self.val_memories}) must divide over {num_workers} workers")
        return p


@dataclass
class DataConfig:
    train_path: str | None = None  # Parquet shards from jobs/build_corpus.py (OUT/train); None: synthetic needles
    val_path: str | None = None  # (OUT/val): validation loss and token accuracy, with and without the memory
    variants: list[str] | None = None  # prompt variants to keep (e.g. hinted imperative); None: all
    max_tokens: int = 1024  # decoder tokens per packed row
    max_chunks: int = 16  # memory chunks per packed row
    chunk_len: int = 512  # tokens per memory chunk
    pad_id: int = 0  # padded positions are masked; the id only has to exist in both vocabularies
    val_examples: int = 256  # validation examples scored at each evaluation
    verify_hashes: bool = True  # sha256 of every shard against the manifest before a job starts (sizes: always)

    def problems(self) -> list[str]:
        """The data section's problems: paths that exist, positive sizes."""
        p: list[str] = []
        d = self
        if d.val_path and not d.train_path:
            p.append("data.val_path needs data.train_path (the synthetic needles bring their own validation)")
        for name in ("max_tokens", "max_chunks", "chunk_len", "val_examples"):
            if getattr(d, name) <= 0:
                p.append(f"data.{name} must be positive, got {getattr(d, name)}")
        for name in ("train_path", "val_path"):
            path = getattr(d, name)
            if path and "://" not in path and not Path(path).exists():
                p.append(f"data.{name} {path} does not exist: build the shards with jobs/build_corpus.py --out DIR "
                         f"and pass DIR/train and DIR/val")
        return p


@dataclass
class StageConfig(JobConfig):
    # 0 needles (or Q&A shards), 1 and 2 commit shards (1: hinted and imperative prompts, the decoder frozen at first;
    # 2: every prompt variant), 4 distillation (jobs/stageN.py sets it; stage 3 makes data)
    stage: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    needle: NeedleConfig = field(default_factory=NeedleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=lambda: DeepSpeedSettings(zero_stage=None))
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    run: RunSettings = field(default_factory=RunSettings)
    tracking: TrackingSettings = field(default_factory=TrackingSettings)

    def problems(self) -> list[str]:
        """Every problem with this config, each naming the field and what would be accepted."""
        p = self.model.problems()
        p += self.needle.problems(self.model.memory, corpus=bool(self.data.train_path),
                                  num_workers=self.scaling.num_workers)
        p += run_problems(self.train, self.scaling, self.deepspeed, self.tracking)
        p += self.data.problems()
        m, d, n = self.model, self.data, self.needle
        if n.mixture_steps > 0 and n.base_until > 0 and self.train.max_steps < n.base_steps + n.mixture_steps:
            p.append(f"train.max_steps ({self.train.max_steps}) is the most a run with needle.mixture_steps may take, "
                     f"and one whose mixture starts at needle.base_steps takes {n.base_steps + n.mixture_steps}: "
                     f"use --train.max_steps {n.base_steps + n.mixture_steps}")
        if m.liger and not self.scaling.use_gpu:
            p.append("model.liger runs Liger-Kernel's Triton kernels, which need GPU workers: set --scaling.use_gpu "
                     "true, or --model.liger false")
        if self.stage in (1, 2) and not d.train_path:
            p.append(f"stage {self.stage} trains on commit shards: build them with `python jobs/build_corpus.py "
                     f"--stage 2 --sources REPO --out DIR` and pass --data.train_path DIR/train "
                     f"--data.val_path DIR/val")
        return p
