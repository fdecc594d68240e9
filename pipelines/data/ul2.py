"""UL2 denoising data for the Qwen3 encoder-decoder: the R/S/X denoiser mixture over token sequences from a Ray
Dataset of text and code files (the UL2 job, `jobs/encoder_ul2.py`, trains on it)."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray.data
import torch
from tokenizers import Tokenizer

from pipelines.format.rows import IGNORE
from pipelines.format.tokenizer import TOKENIZER_FILE, Ul2Vocab, ul2_vocab

REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass
class Ul2DataConfig:
    # files or directories of text/code; empty: this repository's own sources
    paths: list[str] = field(default_factory=list)
    # which files a directory contributes
    suffixes: list[str] = field(
        default_factory=lambda: [".py", ".md", ".txt", ".toml", ".yaml", ".yml", ".json", ".sh"])
    seq_len: int = 128  # tokens per sequence before denoising
    max_files: int = 10_000  # files read at most (in sorted order), so a huge path stays a bounded job
    mixture: str = "ul2"  # a name from MIXTURES
    seed: int = 0  # with the sequence's tokens, seeds its corruption: a rerun or resumed run sees the same examples


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
    roots = [Path(p).expanduser() for p in data.paths if p] or [REPOSITORY]
    suffixes = tuple(data.suffixes)
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


def ul2_dataset(data: Ul2DataConfig, tokenizer_dir: str):
    """Ray Data: files -> byte contents -> token sequences of data.seq_len -> one denoised example per sequence,
    seeded by (data.seed, the sequence's tokens), so a rerun or a resumed run sees the same examples.

    Materialised on the driver before the trainer starts: once the workers hold every CPU of a small node (2 CPU
    workers on 2 cores), streaming tasks would find none left and the pipeline would stall."""
    files = ray.data.read_binary_files(source_files(data), include_paths=False)
    sequences = files.flat_map(functools.partial(_chunk_tokens, tokenizer_dir=tokenizer_dir,
                                                 seq_len=data.seq_len))
    examples = sequences.map(functools.partial(_denoise_row, tokenizer_dir=tokenizer_dir,
                                               mixture=data.mixture, seed=data.seed))
    return examples.materialize()


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str):
    """Once per Ray worker process, not once per row."""
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
            "labels": pad_to(batch["labels"], IGNORE)}
