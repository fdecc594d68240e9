"""The stage jobs' config (jobs/stage0.py, stage1.py, stage2.py, stage4.py, and the sweep's trials): the pair and how
it reads its memory, stage 0's synthetic needles, corpus shards, and stage 4's distillation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from models import PAIRS
from models.awareness import CONFIG_NAME
from models.fusion import CHUNK_WEIGHTS, FUSIONS
from models.placement import resolve_gca_layers
from models.quantization import QUANTIZE
from models.trainable import ATTENTION, EXPERTS, GROUP_TARGETS, MLP, TRAIN_MODES
from pipelines.corpora.shards import MANIFEST
from pipelines.data.memory_modes import MemoryMode, read_system, system_mode
from pipelines.data.synthetic_needles import NeedleSpec
from pipelines.teachers.logits import teacher_identity
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
    fusion: str = "gca"
    gca_mlp: bool = False  # a gated MLP after each cross-attention
    gca_gate_init: float = 0.0  # gates start closed (Flamingo), so a pretrained decoder starts unchanged (gca only)
    # Chunk routing (gca and cross; models/gca.py): each query reads only the memory chunks its top-k summary keys
    # score highest, exact attention over their tokens; > 0 adds a small router per block, trained by the routing loss.
    # 0: the whole memory (full attention)
    memory_top_k: int = 0
    # Weight of the routing loss (KL from full attention's chunk mass to the router's), added in training with
    # memory_top_k > 0; it reaches the routers only. 0: the routers do not learn
    memory_routing_loss: float = 1.0
    # With routing: the routing loss also trains the memory projection and a trained encoder (what the chunk summaries
    # are made of), not the routers alone, so the encoder learns to summarise a chunk's keys for its router
    memory_routing_grad: bool = False
    # With routing: summary keys per chunk, one per block of chunk_len / this tokens, a chunk scoring its best block
    # (must divide the chunk length): one vector per chunk cannot hold every key of a chunk full of similar facts
    memory_summaries: int = 1
    # With routing: how a query's chosen chunks are mixed. attention: one softmax over their tokens (k >= the chunk
    # count is full attention). router: Grouped Cross Attention's fusion, a softmax inside each chunk and the chunk
    # outputs weighted by the softmax of their router scores, so the answer loss trains the routers too
    memory_chunk_weights: str = "attention"
    # With routing: the weight of the question's lexical prior on the chunk scores (models/lexical.py): a chunk holding
    # the question's rare tokens is scored up by their idf, as BM25 ranks, so among near-alike chunks the one naming
    # what is asked is read. 0: the learned router alone. Needs one question a row (no packing)
    memory_lexical_routing: float = 0.0
    # With lexical routing: the prior's weight when the export reads (evaluation, generate, serving: eval mode); None:
    # memory_lexical_routing. Trained at a small weight the learned router still learns; read at a larger one the
    # prior outvotes it where it misranks a memory's filler above a fact (docs/evaluation.md, "Reading weight")
    memory_lexical_reading: float | None = None
    # Length-aware scale (gca and cross): queries times max(1, log n / log N), n the real memory tokens a query
    # reads; N: the memory length trained at (a larger memory then sharpens instead of diluting). 0: off
    memory_logn_scale: int = 0
    decoder: str = "lora"  # frozen | lora | full
    encoder: str = "frozen"  # frozen | lora | full
    gca: str = "full"  # full | lora
    lora_rank: int = 16  # decoder LoRA rank
    lora_alpha: float | None = None  # None: 2 * rank
    lora_targets: list[str] = field(default_factory=lambda: [*ATTENTION, *MLP])  # decoder projections that get LoRA; MoE pairs: add `experts`
    encoder_lora_rank: int = 8  # encoder LoRA rank, when encoder=lora
    gca_lora_rank: int = 8  # GCA LoRA rank, when gca=lora
    encoder_grad_scale: float = 1.0  # multiply the gradient reaching the encoder (the plan suggests 10 when weak)
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, ~30% more compute
    encoder_checkpoint: str | None = None  # e.g. jobs/encoder_ul2.py's export/encoder: replaces the pair's encoder
    init_from: str | None = None  # a previous stage's export/ (GCA, projection, LoRA) to start from, e.g. stage 1's
    # How the memory reaches the decoder: gca (the encoder + GCA blocks), or a baseline trained on the same data:
    # in_context (its chunks in the prompt: long context), rag (the top rag_k chunks by BM25, queried by the prompt, in
    # the prompt), none (the decoder alone). Baselines train only the decoder; the GCA blocks and encoder stay unused,
    # and so do the memory_* reading options (routing, the logn scale): a baseline's model is built without them, as
    # is fusion merged's (its one softmax holds the decoder's own tokens too: nothing to route or scale apart).
    memory: str = "gca"
    context_budget: int = 4096  # memory tokens a prompt may hold (in_context, rag); whole chunks, in memory order
    rag_k: int = 2  # chunks retrieved per question (rag)
    # The frozen decoder and encoder in fewer bits (QLoRA, models/quantization.py): nf4 (4-bit NormalFloat, double
    # quantization) | int8 (LLM.int8) | none. What trains (LoRA, the GCA blocks, routers, the projection) stays in
    # full precision, so a quantized base trains with decoder and encoder lora or frozen
    quantize: str = "none"

    def memory_mode(self) -> MemoryMode:
        return MemoryMode(self.memory, context_budget=self.context_budget, rag_k=self.rag_k)

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
                p.append(f"model.fusion {m.fusion} reads the encoder's memory, and model.memory {m.memory} is a baseline "
                         f"that puts the memory in the prompt (or leaves it out): use model.fusion gca with a baseline")
            if m.gca_mlp:
                p.append(f"model.gca_mlp adds gated MLPs to GCA blocks; model.fusion {m.fusion} has none: drop it")
            if m.fusion == "merged" and m.gca == "lora":
                p.append("model.gca lora puts LoRA on GCA/cross-attention blocks; model.fusion merged has none: use "
                         "model.gca full (the projection) and model.decoder lora")
            if m.fusion == "merged" and m.decoder == "frozen":
                p.append("model.fusion merged adds no attention weights (the decoder's own attention reads the memory): "
                         "train the decoder with model.decoder lora or full")
        if m.memory_top_k < 0:
            p.append(f"model.memory_top_k must be 0 (full attention) or the chunks a query reads, got {m.memory_top_k}")
        if m.memory_logn_scale < 0 or m.memory_logn_scale == 1:
            p.append(f"model.memory_logn_scale must be 0 (off) or the memory length trained at (>= 2), got "
                     f"{m.memory_logn_scale}")
        if m.memory_routing_loss < 0:
            p.append(f"model.memory_routing_loss must be >= 0, got {m.memory_routing_loss}")
        if m.memory_summaries < 1:
            p.append(f"model.memory_summaries must be >= 1 (summary keys per chunk), got {m.memory_summaries}")
        if m.memory_chunk_weights not in CHUNK_WEIGHTS:
            p.append(f"model.memory_chunk_weights must be one of {', '.join(CHUNK_WEIGHTS)}, got "
                     f"{m.memory_chunk_weights!r}")
        elif m.memory_chunk_weights == "router" and (not m.memory_top_k or m.memory_logn_scale):
            p.append("model.memory_chunk_weights router mixes routing's top-k chunks by their scores: set "
                     "model.memory_top_k (e.g. 2) and leave model.memory_logn_scale at 0")
        if m.memory_lexical_routing < 0 or (m.memory_lexical_routing and not m.memory_top_k):
            p.append(f"model.memory_lexical_routing ({m.memory_lexical_routing}) weighs the question's lexical prior "
                     f"on routing's chunk scores: give a weight >= 0, and model.memory_top_k > 0 with a positive one")
        if m.memory_lexical_reading is not None and (m.memory_lexical_reading < 0 or not m.memory_lexical_routing):
            p.append(f"model.memory_lexical_reading ({m.memory_lexical_reading}) is the lexical prior's weight when "
                     f"reading: give a weight >= 0 with a positive model.memory_lexical_routing, or None")
        if m.memory_routing_grad and not m.memory_top_k:
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
    # Training for size and for similar facts (issue 26); each default keeps the task as it was.
    key_tokens: int = 1  # tokens per key (1 or 2); with 2, a hard distractor's key shares all but one token with an asked key
    hard_distractors: float = 0.0  # share (0-1) of a memory's free fact slots filled with facts near-identical to the asked ones (value one digit off, key one token off) instead of filler
    memory_scale_max: int = 1  # each training micro-batch's memories hold 1x..this many times the base chunks, one size drawn per micro-batch from the seed (each doubling as likely)
    variants: list[str] = field(default_factory=lambda: ["single"])  # training mixture of the evaluation's tasks, NAME or NAME:WEIGHT: single multi_key multi_value multi_query variable_tracking
    hops: list[int] = field(default_factory=lambda: [2, 3])  # variable_tracking chain lengths, one drawn per memory
    questions_per_row: int = 4  # in_context training rows: questions asked after one copy of the memory; fewer than facts, so no answer follows by elimination (the evaluation asks one a row)
    base_steps: int = 0  # the first N steps ask the base task alone (single, 1x, no hard distractors) before the mixture, sizes and hard distractors start: the lookup forms there first
    val_memories: int = 64  # held-out memories for needle accuracy
    seed: int = 1234  # training memories come from (seed, index); validation from (seed + 1, index)

    def spec(self) -> NeedleSpec:
        return NeedleSpec(facts=self.facts, questions=self.questions, value_digits=self.value_digits,
                          value_range=self.value_range, chunk_len=self.chunk_len, distractors=self.distractors,
                          key_tokens=self.key_tokens, hard_distractors=self.hard_distractors,
                          memory_scale_max=self.memory_scale_max, variants=tuple(self.variants), hops=tuple(self.hops),
                          questions_per_row=self.questions_per_row, base_steps=self.base_steps)

    def problems(self, memory: str, *, corpus: bool, num_workers: int) -> list[str]:
        """The needle section's problems for a run reading its memory as `memory` (corpus: on shards, not needles)."""
        p = [f"needle: {q}" for q in self.spec().problems()]
        n = self
        if memory == "in_context" and not corpus and 1 < n.facts <= min(n.questions_per_row, n.questions):
            p.append(f"needle.questions_per_row ({n.questions_per_row}) asks all {n.facts} facts of a memory in one "
                     f"in_context row, so its last answer follows by elimination: use --needle.questions_per_row "
                     f"{max(1, n.facts // 2)} (or ask fewer --needle.questions)")
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


K_RANGE = (8, 256)  # top-k stored per target token; the range is 32-64 (k * 6 bytes a token)


@dataclass
class DistillConfig:
    """Stage 4: the student (the GCA pair) learns from a teacher that reads the same memory in its prompt. Used only
    by stage 4 (jobs/stage4.py)."""

    teacher: str | None = None  # an export whose system.json reads the memory in its prompt (in_context or rag)
    teacher_steps: int = 0  # with no teacher: first train an in_context teacher on the same data for this many steps
    k: int = 32  # teacher top-k kept per target token (32-64: k * 6 bytes a token; pipelines.teachers.logits)
    alpha: float = 0.5  # loss = alpha * KL(teacher || student) over the top-k + (1 - alpha) * cross-entropy
    temperature: float = 1.0  # softens both sides of the KL (scaled by temperature^2)
    logits: str | None = None  # the teacher logits directory; None: CORPUS/teacher_logits, computed when absent or
    # written by another teacher, k or corpus. A directory named here must hold this teacher's logits (or none yet).
    actors: int = 1  # Ray Data actors scoring the corpus with the teacher
    use_gpu: bool = False  # one GPU per teacher actor
    baseline: bool = True  # also train the same student with alpha 0 on the same data and steps, to compare
    # The embedded default corpus (used when data.train_path is unset): one needle fact per memory, its value digits
    # copied into the target, each replaced by a random digit with probability label_noise.
    label_noise: float = 0.3
    train_rows: int = 4096  # rows of the embedded default corpus for training
    val_rows: int = 256  # and for validation

    def problems(self, stage: int) -> list[str]:
        if stage != 4:
            return []
        p = []
        if self.teacher:
            p += teacher_problems(self.teacher)
        elif self.teacher_steps <= 0:
            p.append("distill.teacher is missing: name a teacher export (--distill.teacher EXPORT, a stage run with "
                     "--model.memory in_context or rag), or train one first with --distill.teacher_steps N")
        if not K_RANGE[0] <= self.k <= K_RANGE[1]:
            p.append(f"distill.k must be within {K_RANGE[0]}-{K_RANGE[1]} (32-64 intended: k * 6 bytes per target "
                     f"token), got {self.k}")
        if not 0.0 <= self.alpha <= 1.0:
            p.append(f"distill.alpha must be within [0, 1] (the KL's weight), got {self.alpha}")
        if self.temperature <= 0:
            p.append(f"distill.temperature must be positive, got {self.temperature}")
        if self.actors <= 0:
            p.append("distill.actors must be positive")
        if not 0.0 <= self.label_noise < 1.0:
            p.append(f"distill.label_noise must be within [0, 1), got {self.label_noise}")
        if self.train_rows <= 0 or self.val_rows <= 0:
            p.append("distill.train_rows and distill.val_rows must be positive")
        if self.teacher and self.logits and not p:
            p += logits_problems(self.logits, self.teacher, self.k)
        return p


def teacher_problems(teacher: str) -> list[str]:
    if not (Path(teacher) / CONFIG_NAME).is_file():
        return [f"distill.teacher {teacher} is not an export (no {CONFIG_NAME}): pass the `export` path of a "
                f"finished stage run trained with --model.memory in_context (or rag)"]
    mode = system_mode(read_system(teacher))
    if not mode.in_prompt:
        return [f"distill.teacher {teacher} reads its memory as {mode.kind!r}; a teacher must read it in its prompt: "
                f"train it with --model.memory in_context (or rag)"]
    return []


def logits_problems(logits: str, teacher: str, k: int) -> list[str]:
    """Stored logits named explicitly must be this teacher's, at this k (the default directory is recomputed instead)."""
    manifest = Path(logits) / MANIFEST
    if not manifest.is_file():
        return []  # computed there
    stored = json.loads(manifest.read_text())
    problems = []
    if stored.get("teacher", {}).get("weights_sha256") != teacher_identity(teacher)["weights_sha256"]:
        problems.append(f"distill.logits {logits} holds the logits of another teacher ({stored.get('teacher', {}).get('export')}), "
                        f"not of {teacher}: omit --distill.logits to compute this teacher's beside the corpus, or "
                        f"name an empty directory")
    if stored.get("k") != k:
        problems.append(f"distill.logits {logits} holds top-{stored.get('k')} logits, and distill.k is {k}: set "
                        f"--distill.k {stored.get('k')} or name another directory")
    return problems


@dataclass
class StageConfig(JobConfig):
    stage: int = 0  # 0 needles, 1 code/doc Q&A, 2 commits, 4 distillation (jobs/stageN.py sets it; stage 3 makes data)
    model: ModelConfig = field(default_factory=ModelConfig)
    needle: NeedleConfig = field(default_factory=NeedleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    run: RunSettings = field(default_factory=RunSettings)
    tracking: TrackingSettings = field(default_factory=TrackingSettings)
    distill: DistillConfig = field(default_factory=DistillConfig)  # stage 4 only

    def problems(self) -> list[str]:
        """Every problem with this config, each naming the field and what would be accepted."""
        p = self.model.problems()
        p += self.needle.problems(self.model.memory, corpus=bool(self.data.train_path),
                                  num_workers=self.scaling.num_workers)
        p += run_problems(self.train, self.scaling, self.deepspeed, self.tracking)
        p += self.data.problems()
        p += self.distill.problems(self.stage)
        m, d = self.model, self.data
        if self.stage == 4 and m.memory != "gca":
            p.append(f"stage 4 trains a GCA student (model.memory gca) from a teacher reading its prompt; got "
                     f"model.memory {m.memory!r}")
        if self.stage in (1, 2) and not d.train_path:
            p.append(f"stage {self.stage} trains on commit shards: build them with `python jobs/build_corpus.py "
                     f"--stage 2 --sources REPO --out DIR` and pass --data.train_path DIR/train --data.val_path DIR/val")
        return p
