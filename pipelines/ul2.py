"""UL2 for the Qwen3 encoder-decoder: the R/S/X denoiser mixture over token sequences from a Ray Dataset of text and
code files, trained on Ray Train + DeepSpeed (the stage jobs' path, pipelines/training.py), tracked in MLflow.

Its product is the encoder: `export/encoder` is a plain Qwen3 checkpoint that `models.build_pair(...,
encoder_checkpoint=...)` reads bidirectionally as the Awareness memory encoder.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from pipelines.config import (DeepSpeedSettings, RunSettings, ScalingSettings, TrackingSettings, TrainConfig,
                              from_typed_dict, parse_config)
from pipelines.training import EXPORT_DIR  # one checkpoint layout for every job

TOKENIZER_FILE = "tokenizer.json"
SPECIALS = ("<pad>", "<s>", "</s>", "[R]", "[S]", "[X]")  # padding, decoder start, end, the UL2 mode tokens
SENTINELS = 100  # <extra_id_0> ... <extra_id_99>: one per corrupted span
TINY_CHECKPOINT = "tiny-qwen3-ul2"


# --------------------------------------------------------------------------------------------------- configs
@dataclass
class Ul2ModelConfig:
    checkpoint: str | None = None  # a decoder-only Qwen3 checkpoint directory; None: a tiny random one (CPU default)
    checkpoint_root: str | None = None  # where the tiny one is written; None: ~/.cache/awareness/random-checkpoints
    encoder_key_rope: str = "none"  # none (T5Gemma 2, measured better) | encoder_positions
    encoder_layers: int | None = None  # None: all of the checkpoint's layers
    gradient_checkpointing: bool = False


@dataclass
class Ul2DataConfig:
    paths: str = ""  # comma-separated files or directories of text/code; empty: this repository's own sources
    suffixes: str = ".py,.md,.txt,.toml,.yaml,.yml,.json,.sh"  # which files a directory contributes
    seq_len: int = 128  # tokens per sequence before denoising
    max_files: int = 10_000
    mixture: str = "ul2"  # a name from MIXTURES
    seed: int = 0


@dataclass
class Ul2Config:
    """One typed section per concern, as the stage jobs; train.memories_per_step counts sequences here."""

    model: Ul2ModelConfig = field(default_factory=Ul2ModelConfig)
    data: Ul2DataConfig = field(default_factory=Ul2DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    scaling: ScalingSettings = field(default_factory=ScalingSettings)
    run: RunSettings = field(default_factory=lambda: RunSettings(name="encoder-ul2"))
    tracking: TrackingSettings = field(default_factory=TrackingSettings)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Ul2Config":
        return from_typed_dict(cls, data)

    def validate(self) -> "Ul2Config":
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
        for name in ("max_steps", "memories_per_step", "grad_accum", "log_every", "checkpoint_every"):
            if getattr(t, name) <= 0:
                p.append(f"train.{name} must be positive, got {getattr(t, name)}")
        if t.memories_per_step % (self.scaling.num_workers * t.grad_accum):
            p.append(f"train.memories_per_step ({t.memories_per_step}) must divide evenly over scaling.num_workers "
                     f"({self.scaling.num_workers}) x train.grad_accum ({t.grad_accum})")
        if p:
            raise ValueError("invalid UL2 config:\n  - " + "\n  - ".join(p))
        return self


def parse_ul2_config(argv: list[str] | None, default: Ul2Config, description: str = "") -> Ul2Config:
    """default < --config FILE < --section.field VALUE, the stage jobs' parser."""
    return parse_config(argv, default, description)


# ------------------------------------------------------------------------------------------ tokenizer, vocab
def write_byte_tokenizer(directory: str | Path) -> Path:
    """A real `tokenizers` byte-level tokenizer: 256 byte tokens (ids 0-255), then SPECIALS and the sentinels
    (362 ids: fits the tiny checkpoints' 512-row vocabulary). Any text round-trips; no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([*SPECIALS, *(f"<extra_id_{i}>" for i in range(SENTINELS))])
    path = Path(directory) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def _byte_of(char: str) -> int:
    """GPT-2's byte-to-unicode map, inverted: printable bytes map to themselves, the rest to 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(char) in printable:
        return ord(char)
    rest = [b for b in range(256) if b not in printable]
    return rest[ord(char) - 256]


@dataclass(frozen=True)
class Ul2Vocab:
    """The token ids the denoisers write."""

    pad: int
    start: int
    eos: int
    modes: dict[str, int]
    sentinels: tuple[int, ...]


def load_tokenizer(checkpoint: str | Path, vocab_size: int):
    """The checkpoint's tokenizer.json, with the UL2 specials added when it lacks them (a real Qwen3 tokenizer gets
    them in its unused rows, ids 151669+); refuses ids the model has no row for."""
    from tokenizers import Tokenizer

    path = Path(checkpoint) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(checkpoint)!r} has no {TOKENIZER_FILE}: UL2 tokenizes with the checkpoint's own "
                                f"tokenizer (a Hugging Face Qwen3 download has one)")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens([*SPECIALS[3:], *(f"<extra_id_{i}>" for i in range(SENTINELS))])
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise ValueError(f"the tokenizer with UL2's {len(SPECIALS) - 3 + SENTINELS} added tokens has "
                         f"{tokenizer.get_vocab_size(with_added_tokens=True)} ids but the model {vocab_size} rows: "
                         f"resize the model's embeddings (model.resize_token_embeddings) before training")
    return tokenizer


def ul2_vocab(tokenizer) -> Ul2Vocab:
    """Our byte tokenizer's <pad>/<s>/</s>, or Qwen3's <|endoftext|> (pad and start) and <|im_end|> (end)."""
    ids = tokenizer.token_to_id
    pad = ids("<pad>") if ids("<pad>") is not None else ids("<|endoftext|>")
    start = ids("<s>") if ids("<s>") is not None else ids("<|endoftext|>")
    eos = ids("</s>") if ids("</s>") is not None else ids("<|im_end|>")
    if None in (pad, start, eos):
        raise ValueError("the tokenizer has neither <pad>/<s>/</s> nor Qwen3's <|endoftext|>/<|im_end|>")
    return Ul2Vocab(pad=pad, start=start, eos=eos, modes={m: ids(f"[{m}]") for m in "RSX"},
                    sentinels=tuple(ids(f"<extra_id_{i}>") for i in range(SENTINELS)))


# --------------------------------------------------------------------------------------------------- denoisers
@dataclass(frozen=True)
class Denoiser:
    """R: short spans, little noise (T5); X: long spans or much noise (extreme); S: prefix LM (sequential)."""

    mode: str
    mean_span: float = 3.0
    noise_density: float = 0.15
    weight: float = 1.0


# The UL2 paper's seven denoisers; S gets a fifth of the mixture, R and X the rest evenly.
MIXTURES: dict[str, tuple[Denoiser, ...]] = {
    "ul2": (Denoiser("R", 3, 0.15, 0.2), Denoiser("R", 8, 0.15, 0.2), Denoiser("X", 3, 0.5, 0.1),
            Denoiser("X", 8, 0.5, 0.1), Denoiser("X", 64, 0.15, 0.1), Denoiser("X", 64, 0.5, 0.1),
            Denoiser("S", weight=0.2)),
    "span": (Denoiser("R", 3, 0.15),),  # T5's span corruption alone
    "prefix": (Denoiser("S"),),  # prefix LM alone
}


def random_segments(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """`total` split into `parts` positive lengths, uniformly at random."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False)) if parts > 1 else np.array([], int)
    return np.diff(np.concatenate([[0], cuts, [total]]))


def span_corruption(tokens: np.ndarray, denoiser: Denoiser, vocab: Ul2Vocab, rng: np.random.Generator):
    """T5's span corruption: ~noise_density of the tokens in spans of ~mean_span, each replaced in the inputs by a
    sentinel; the targets list each sentinel followed by the tokens it hides, then </s>."""
    n = len(tokens)
    noise = int(np.clip(round(n * denoiser.noise_density), 1, n - 1))
    spans = int(np.clip(round(noise / denoiser.mean_span), 1, min(noise, n - noise, len(vocab.sentinels))))
    noise_lengths, keep_lengths = random_segments(noise, spans, rng), random_segments(n - noise, spans, rng)
    inputs, targets, at = [vocab.modes[denoiser.mode]], [], 0
    for i, (keep, hide) in enumerate(zip(keep_lengths, noise_lengths)):
        inputs += [*tokens[at : at + keep], vocab.sentinels[i]]
        targets += [vocab.sentinels[i], *tokens[at + keep : at + keep + hide]]
        at += keep + hide
    return inputs, targets + [vocab.eos]


def prefix_lm(tokens: np.ndarray, vocab: Ul2Vocab, rng: np.random.Generator):
    """The S-denoiser: a random split; the encoder reads the prefix, the decoder continues it."""
    split = int(rng.integers(1, len(tokens)))
    return [vocab.modes["S"], *tokens[:split]], [*tokens[split:], vocab.eos]


def denoise(tokens: np.ndarray, vocab: Ul2Vocab, mixture: tuple[Denoiser, ...], rng: np.random.Generator):
    """One example from the mixture: (encoder input ids, target ids, denoiser mode)."""
    weights = np.array([d.weight for d in mixture])
    denoiser = mixture[rng.choice(len(mixture), p=weights / weights.sum())]
    if denoiser.mode == "S":
        return (*prefix_lm(tokens, vocab, rng), "S")
    return (*span_corruption(tokens, denoiser, vocab, rng), denoiser.mode)


# -------------------------------------------------------------------------------------------------------- data
def source_files(data: Ul2DataConfig) -> list[str]:
    """The files named, directories expanded by suffix; the repository's own sources when none are named."""
    roots = [Path(p).expanduser() for p in data.paths.split(",") if p] or [Path(__file__).resolve().parents[1]]
    suffixes = tuple(s.strip() for s in data.suffixes.split(","))
    files: list[str] = []
    for root in roots:
        if root.is_file():
            files.append(str(root.resolve()))
        elif root.is_dir():
            files += sorted(str(f.resolve()) for f in root.rglob("*") if f.is_file() and f.suffix in suffixes
                            and not any(part.startswith(".") for part in f.relative_to(root).parts))
        else:
            raise FileNotFoundError(f"data.paths names {str(root)!r}, which does not exist")
    if not files:
        raise ValueError(f"no {suffixes} files under {data.paths or roots[0]}: point data.paths at text or code")
    return files[: data.max_files]


def ul2_dataset(config: Ul2Config, tokenizer_dir: str):
    """Ray Data: files -> byte contents -> token sequences of data.seq_len -> one denoised example per sequence,
    seeded by (data.seed, the sequence's tokens), so a rerun or a resumed run sees the same examples.

    Materialised on the driver before the trainer starts: once the workers hold every CPU of a small node (2 CPU
    workers on 2 cores), streaming tasks would find none left and the pipeline would stall."""
    import ray.data

    files = ray.data.read_binary_files(source_files(config.data), include_paths=False)
    sequences = files.flat_map(functools.partial(_chunk_tokens, tokenizer_dir=tokenizer_dir,
                                                 seq_len=config.data.seq_len))
    examples = sequences.map(functools.partial(_denoise_row, tokenizer_dir=tokenizer_dir,
                                               mixture=config.data.mixture, seed=config.data.seed))
    return examples.materialize()


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str):
    """Once per Ray worker process, not once per row."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_dir) / TOKENIZER_FILE))


def _chunk_tokens(row: dict[str, Any], tokenizer_dir: str, seq_len: int) -> list[dict[str, Any]]:
    """One file's bytes -> rows {"tokens": seq_len ids}; a tail shorter than a quarter sequence is dropped."""
    ids = _tokenizer(tokenizer_dir).encode(row["bytes"].decode("utf-8", errors="replace")).ids
    chunks = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    return [{"tokens": np.asarray(c, dtype=np.int64)} for c in chunks if len(c) >= max(16, seq_len // 4)]


def _denoise_row(row: dict[str, Any], tokenizer_dir: str, mixture: str, seed: int) -> dict[str, Any]:
    tokens = np.asarray(row["tokens"], dtype=np.int64)
    digest = hashlib.blake2b(tokens.tobytes(), digest_size=8).digest()
    rng = np.random.default_rng([seed, int.from_bytes(digest, "little")])
    inputs, targets, mode = denoise(tokens, ul2_vocab(_tokenizer(tokenizer_dir)), MIXTURES[mixture], rng)
    return {"input_ids": np.asarray(inputs, np.int64), "labels": np.asarray(targets, np.int64), "mode": mode}


def collate(batch: dict[str, np.ndarray], pad: int) -> dict[str, torch.Tensor]:
    """Right-pads the ragged encoder inputs (mask 0) and targets (-100: no loss, shifted in as padding)."""

    def pad_to(rows, value):
        out = torch.full((len(rows), max(len(r) for r in rows)), value, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(np.asarray(r, dtype=np.int64))
        return out

    input_ids = pad_to(batch["input_ids"], pad)
    return {"input_ids": input_ids, "attention_mask": pad_to([np.ones(len(r)) for r in batch["input_ids"]], 0),
            "labels": pad_to(batch["labels"], -100)}


# ------------------------------------------------------------------------------------------- Ray Train worker
@dataclass
class Ul2State:
    """What a checkpoint carries besides the engine's shards."""

    step: int = 0
    examples_seen: int = 0
    losses: list[float] = field(default_factory=list)  # every step's loss (Ray keeps only checkpointed reports)


def ul2_train_loop(loop_config: dict[str, Any]) -> None:
    import ray.train

    from pipelines.tracking import Tracker
    from pipelines.training import quiet_known_warnings, restore_checkpoint, save_checkpoint

    config = Ul2Config.from_dict(loop_config["config"])
    quiet_known_warnings()
    torch.manual_seed(config.train.seed)
    model = build_seq2seq(config.model, loop_config["checkpoint"], loop_config["start_token"])
    engine = setup_engine(model, config)
    state = restore_checkpoint(engine, Ul2State)
    rank = ray.train.get_context().get_world_rank()
    tracker = Tracker(loop_config.get("tracking_uri"), loop_config.get("mlflow_run_id") if rank == 0 else None)
    batches = batch_stream(config, loop_config["pad"])
    seconds: list[float] = []
    while state.step < config.train.max_steps:
        metrics = ul2_step(engine, batches, config, state)
        seconds.append(metrics["step_seconds"])
        metrics["step_seconds_median"] = statistics.median(seconds[-100:])
        final = state.step == config.train.max_steps
        if state.step % config.train.log_every == 0 or final:
            tracker.log_metrics(metrics, state.step)
        if state.step % config.train.checkpoint_every == 0 or final:
            save_checkpoint(engine, state, metrics,
                            export=functools.partial(export, engine, config, checkpoint=loop_config["checkpoint"]) if final else None)
        else:
            ray.train.report(metrics)


def build_seq2seq(cfg: Ul2ModelConfig, checkpoint: str, start_token: int):
    from models import Qwen3ForSeq2SeqLM

    model = Qwen3ForSeq2SeqLM.from_qwen3(checkpoint, encoder_key_rope=cfg.encoder_key_rope,
                                         encoder_layers=cfg.encoder_layers, decoder_start_token_id=start_token)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def setup_engine(model, config: Ul2Config):
    """The stage jobs' DeepSpeed setup (AdamW + cosine schedule handed to DeepSpeed, ZeRO config from train /
    deepspeed sections); everything trains, so it is one parameter group."""
    from pipelines.training import setup_deepspeed

    return setup_deepspeed(model, config)  # reads only config.train and config.deepspeed


def batch_stream(config: Ul2Config, pad: int) -> Iterator[dict[str, torch.Tensor]]:
    """This worker's shard of the dataset, micro-batch by micro-batch, epoch after epoch (equal shards and
    drop_last keep every worker on the same step count, as DeepSpeed's collectives need)."""
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    t = config.train
    per_rank = t.memories_per_step // (t.grad_accum * ray.train.get_context().get_world_size())
    while True:
        for batch in shard.iter_batches(batch_size=per_rank, drop_last=True, batch_format="numpy"):
            yield collate(batch, pad)


def ul2_step(engine, batches: Iterator, config: Ul2Config, state) -> dict[str, float]:
    import torch.distributed as dist

    started, losses, tokens = time.perf_counter(), [], 0
    for _ in range(config.train.grad_accum):
        batch = {k: v.to(engine.device) for k, v in next(batches).items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        tokens += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
    totals = torch.tensor([torch.stack(losses).mean().item(), tokens], dtype=torch.float64)
    dist.all_reduce(totals)
    state.step += 1
    state.examples_seen += config.train.memories_per_step
    state.losses.append(totals[0].item() / dist.get_world_size())
    elapsed = time.perf_counter() - started
    return {"loss": state.losses[-1], "loss_first": state.losses[0], "lr": engine.get_lr()[0],
            "tokens_per_s": totals[1].item() / elapsed, "step_seconds": elapsed,
            "examples_seen": state.examples_seen}


def export(engine, config: Ul2Config, directory: Path, checkpoint: str) -> None:
    """export/seq2seq (the whole model) and export/encoder (a plain Qwen3 checkpoint for the Awareness memory
    encoder), each with the tokenizer, gathered from the ZeRO-3 shards and written by rank 0."""
    import deepspeed
    import torch.distributed as dist

    from models import Qwen3EncoderModel

    model = engine.module
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=config.deepspeed.zero_stage == 3):
        if dist.get_rank() == 0:
            model.save_pretrained(directory / "seq2seq")
            Qwen3EncoderModel.from_seq2seq(model).save_pretrained(directory / "encoder")
            for sub in ("seq2seq", "encoder"):
                shutil.copy(Path(checkpoint) / TOKENIZER_FILE, directory / sub / TOKENIZER_FILE)
    dist.barrier()


# ---------------------------------------------------------------------------------------------------- driver
def prepare_checkpoint(config: Ul2Config) -> tuple[str, str]:
    """(checkpoint dir, tokenizer dir). The tiny default: the `tiny` pair's decoder architecture with random
    weights and a byte-level tokenizer, written once under the checkpoint root. A real checkpoint: its own
    tokenizer.json plus UL2's added tokens, saved next to the run (never into the checkpoint)."""
    from models.pairs import PAIRS, decoder_config, default_tiny_root

    if config.model.checkpoint:
        return str(Path(config.model.checkpoint).expanduser().resolve()), ""
    root = Path(config.model.checkpoint_root or default_tiny_root()).expanduser().resolve()
    directory = root / TINY_CHECKPOINT
    if not (directory / TOKENIZER_FILE).is_file() or not (directory / "config.json").is_file():
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(0)
        Qwen3ForCausalLM(decoder_config(PAIRS["tiny"])).save_pretrained(directory)
        write_byte_tokenizer(directory)
    return str(directory), str(directory)


def run_ul2(config: Ul2Config) -> dict[str, Any]:
    """Trains on Ray Train and returns the job's summary; a rerun with the same run.name resumes."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from pipelines.tracking import Tracker, resolve_tracking_uri

    config = config.validate()
    config = dataclasses.replace(config, run=dataclasses.replace(
        config.run, storage_path=str(Path(config.run.storage_path).expanduser().resolve())))
    checkpoint, tokenizer_dir = prepare_checkpoint(config)
    run_dir = Path(config.run.storage_path) / config.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    if not tokenizer_dir:  # a real checkpoint: its tokenizer with UL2's tokens, kept with the run
        load_tokenizer(checkpoint, _vocab_size(checkpoint)).save(str(run_dir / TOKENIZER_FILE))
        tokenizer_dir = str(run_dir)
    from tokenizers import Tokenizer

    vocab = ul2_vocab(Tokenizer.from_file(str(Path(tokenizer_dir) / TOKENIZER_FILE)))
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri)
    tracker = Tracker(None, None)
    if config.tracking.enabled:
        tracker = Tracker.start(tracking_uri, config.tracking.experiment, config.run.name, config.to_dict(),
                                {"job": "encoder_ul2", "checkpoint": checkpoint})
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    trainer = TorchTrainer(
        ul2_train_loop,
        train_loop_config={"config": config.to_dict(), "checkpoint": checkpoint, "start_token": vocab.start,
                           "pad": vocab.pad, "tracking_uri": tracking_uri, "mlflow_run_id": tracker.run_id},
        datasets={"train": ul2_dataset(config, tokenizer_dir)},
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.scaling.num_workers, use_gpu=config.scaling.use_gpu,
            resources_per_worker={"CPU": config.scaling.cpus_per_worker, **({"GPU": 1} if config.scaling.use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=config.run.name, storage_path=config.run.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=config.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.run.keep_checkpoints),
        ),
    )
    return summarise(config, trainer.fit(), tracker)


def _vocab_size(checkpoint: str) -> int:
    return int(json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"])


def summarise(config: Ul2Config, result, tracker) -> dict[str, Any]:
    metrics = result.metrics or {}
    checkpoint = result.checkpoint.path if result.checkpoint else None
    export_dir = f"{checkpoint}/{EXPORT_DIR}" if checkpoint else None
    summary = {
        "job": "encoder_ul2",
        "steps": metrics.get("examples_seen", 0) // config.train.memories_per_step,
        "loss_first": metrics.get("loss_first"),
        "loss_last": metrics.get("loss"),
        "seconds_per_step": metrics.get("step_seconds_median"),
        "checkpoint": checkpoint,
        "seq2seq": f"{export_dir}/seq2seq" if export_dir else None,
        "encoder": f"{export_dir}/encoder" if export_dir else None,
        "mlflow_run_id": tracker.run_id,
        "error": repr(result.error) if result.error else None,
    }
    if checkpoint and Path(checkpoint, EXPORT_DIR).is_dir():
        tracker.log_artifacts(Path(checkpoint) / EXPORT_DIR / "encoder", "encoder")
    tracker.log_dict(summary, "summary.json")
    summary["tracking_unlogged"] = tracker.close("FAILED" if result.error else "FINISHED")
    return summary
