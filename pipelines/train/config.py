"""Typed configs for the stage jobs: one dataclass per concern, a config file plus command-line overrides, and a
validation that collects every problem into one message. Converted to a dict only at the Ray Train boundary."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from models import PAIRS
from models.awareness import CONFIG_NAME
from models.fusion import FUSIONS
from models.placement import resolve_gca_layers
from models.trainable import ATTENTION, EXPERTS, GROUP_TARGETS, MLP, TRAIN_MODES
from pipelines.cli import ConfigError, from_typed_dict
from pipelines.corpora.shards import MANIFEST
from pipelines.data.memory_modes import MemoryMode, read_system, system_mode
from pipelines.data.synthetic_needles import NeedleSpec
from pipelines.data.traffic_scenes import QUESTION_TYPES
from pipelines.data.traffic_tokenizer import vocabulary
from pipelines.data.ul2 import MIXTURES, Ul2DataConfig
from pipelines.teachers.logits import teacher_identity


class JobConfig:
    """What every training job's typed config shares: the dict it crosses the Ray Train boundary as, its parsing,
    and a validation that raises every problem at once (each subclass lists its own in `problems`)."""

    KIND: ClassVar[str] = "config"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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


def run_problems(t: "TrainConfig", scaling: "ScalingSettings", deepspeed: "DeepSpeedSettings") -> list[str]:
    """The checks of the sections every training job has: the schedule, the workers, DeepSpeed."""
    p = [f"train.{name} must be positive, got {getattr(t, name)}" for name in
         ("max_steps", "memories_per_step", "grad_accum", "log_every", "eval_every", "checkpoint_every")
         if getattr(t, name) <= 0]
    if t.lr <= 0 or not 0 <= t.min_lr_ratio <= 1:
        p.append("train.lr must be positive and train.min_lr_ratio within [0, 1]")
    if scaling.num_workers <= 0:
        p.append("scaling.num_workers must be positive")
    elif t.memories_per_step % (scaling.num_workers * t.grad_accum):
        p.append(f"train.memories_per_step ({t.memories_per_step}) must divide evenly over scaling.num_workers "
                 f"({scaling.num_workers}) x train.grad_accum ({t.grad_accum})")
    if deepspeed.zero_stage not in (0, 1, 2, 3):
        p.append(f"deepspeed.zero_stage must be 0-3, got {deepspeed.zero_stage}")
    if deepspeed.precision not in ("auto", "bf16", "fp32"):
        p.append(f"deepspeed.precision must be auto, bf16 or fp32, got {deepspeed.precision!r}")
    if deepspeed.offload_params and deepspeed.zero_stage != 3:
        p.append("deepspeed.offload_params needs deepspeed.zero_stage 3")
    return p


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
    # the prompt), none (the decoder alone). Baselines train only the decoder; the GCA blocks and encoder stay unused.
    memory: str = "gca"
    context_budget: int = 4096  # memory tokens a prompt may hold (in_context, rag); whole chunks, in memory order
    rag_k: int = 2  # chunks retrieved per question (rag)

    def memory_mode(self) -> MemoryMode:
        return MemoryMode(self.memory, context_budget=self.context_budget, rag_k=self.rag_k)


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
    val_memories: int = 64  # held-out memories for needle accuracy
    seed: int = 1234  # training memories come from (seed, index); validation from (seed + 1, index)

    def spec(self) -> NeedleSpec:
        return NeedleSpec(facts=self.facts, questions=self.questions, value_digits=self.value_digits,
                          value_range=self.value_range, chunk_len=self.chunk_len, distractors=self.distractors,
                          key_tokens=self.key_tokens, hard_distractors=self.hard_distractors,
                          memory_scale_max=self.memory_scale_max, variants=tuple(self.variants), hops=tuple(self.hops),
                          questions_per_row=self.questions_per_row)


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


@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps; the schedule's length
    memories_per_step: int = 16  # global batch, in memories (each carries needle.questions questions)
    grad_accum: int = 1  # micro-batches per optimizer step (memories_per_step is split over workers and these)
    lr: float = 2e-4  # peak learning rate (AdamW), reached after warmup_steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30  # linear warm-up from 0 to lr
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # gradient norm clipped to this (0: no clipping)
    frozen_decoder_steps: int = 0  # the plan's warm-up phase: decoder updates start after this many steps
    log_every: int = 20  # steps between progress lines and logged metrics
    eval_every: int = 200  # steps between validation evaluations (and one at the end)
    checkpoint_every: int = 200  # steps between checkpoints (and one at the end); a resumed run starts from the last
    seed: int = 0  # model initialisation and data order


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
class DeepSpeedSettings:
    zero_stage: int = 3  # ZeRO stage: 3 partitions parameters, gradients and optimizer states; 2 all but parameters
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (GPU clusters)
    offload_params: bool = False  # ZeRO-3 parameter offload to CPU (GPU clusters)


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
        p: list[str] = []
        m, t = self.model, self.train
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
        if (m.memory_top_k or m.memory_logn_scale) and m.fusion == "merged":
            p.append("model.memory_top_k and model.memory_logn_scale route and scale a memory-only attention: use "
                     "model.fusion gca or cross (merged reads the memory in the decoder's own softmax)")
        if (m.memory_top_k or m.memory_logn_scale) and m.memory != "gca":
            p.append(f"model.memory_top_k and model.memory_logn_scale apply to the encoder's memory; model.memory "
                     f"{m.memory} puts it in the prompt (or leaves it out): set them to 0")
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
        p += [f"needle: {q}" for q in self.needle.spec().problems()]
        n = self.needle
        if m.memory == "in_context" and not self.data.train_path and 1 < n.facts <= min(n.questions_per_row, n.questions):
            p.append(f"needle.questions_per_row ({n.questions_per_row}) asks all {n.facts} facts of a memory in one "
                     f"in_context row, so its last answer follows by elimination: use --needle.questions_per_row "
                     f"{max(1, n.facts // 2)} (or ask fewer --needle.questions)")
        p += run_problems(t, self.scaling, self.deepspeed)
        d = self.data
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
        p += self.distill.problems(self.stage)
        if self.stage == 4 and m.memory != "gca":
            p.append(f"stage 4 trains a GCA student (model.memory gca) from a teacher reading its prompt; got "
                     f"model.memory {m.memory!r}")
        if self.stage in (1, 2) and not d.train_path:
            p.append(f"stage {self.stage} trains on commit shards: build them with `python jobs/build_corpus.py "
                     f"--stage 2 --source REPO --out DIR` and pass --data.train_path DIR/train --data.val_path DIR/val")
        if self.needle.val_memories % self.scaling.num_workers:
            p.append(f"needle.val_memories ({self.needle.val_memories}) must divide over {self.scaling.num_workers} workers")
        return p



# ------------------------------------------------------------------------------ the encoder-decoder UL2 job
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
                     f"Qwen3 checkpoint (config.json, *.safetensors, tokenizer.json), or leave it empty for the tiny one")
        if self.data.mixture not in MIXTURES:
            p.append(f"data.mixture {self.data.mixture!r} is not one of {sorted(MIXTURES)}")
        if self.data.seq_len < 16:
            p.append(f"data.seq_len must be at least 16 tokens, got {self.data.seq_len}")
        return p + run_problems(t, self.scaling, self.deepspeed)



# ------------------------------------------------------------------------------ the traffic-scene VLM job
TRAFFIC_VOCAB = len(vocabulary())

@dataclass
class TrafficModelConfig:
    """The traffic-scene VLM (models/traffic_vlm.py): a SigLIP vision tower whose patch states the classic
    cross-attention decoder reads; the decoder keeps the seed's small configuration unless told otherwise."""

    vision_path: str | None = None  # a local SigLIP checkpoint directory (safetensors); None: a random tower built from the vision_* fields
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
    # question a row, as the held-out scenes are asked (pipelines.train.recipes.traffic.collate_packed says why)
    shuffle_buffer: int = 512  # rows each worker shuffles locally while streaming
    grid_scenes: int = 12  # held-out scenes drawn with question, prediction and truth in the logged grid


@dataclass
class TrafficTrackingSettings(TrackingSettings):
    registered_model: str | None = "traffic-vlm"  # the pyfunc is registered under this name (alias candidate); None: logged, not registered


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
        return p + run_problems(t, self.scaling, self.deepspeed)

