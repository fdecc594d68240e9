"""Teacher top-k log-probs for distillation (stage 4): computed once with Ray Data, stored beside the corpus's shards.

The teacher is a model that reads the same memory in its prompt: an export whose system.json says `in_context` (or
`rag`), loaded by AwarenessModel.from_pretrained. For each corpus row it reads the row as it would at evaluation
(`memory_into_prompt`: the memory chunks, up to its context budget, before the student's prompt), and at each of the
student's target positions t (labels[t] != -100, t >= 1, in the student's row) it keeps the top-k token ids and
their log-probs (log-softmax over the full vocabulary, temperature 1) for predicting token t. The teacher's row has
`shift` memory tokens prepended, so that prediction is its logits at position t + shift - 1.

    OUT/manifest.json               teacher identity, k, rows, target tokens, rows skipped by reason, the bytes per
                                    target token, and every shard (bytes, rows, row groups, sha256, as the corpus's)
    OUT/<split>/<shard>-<group>.parquet   one file per row group of the corpus split; one row per corpus row:
        id              the row's global id in the split's fixed order (pipelines.format.shards), to join on
        skipped         "" or why the teacher did not score the row (too_long: over its context budget; no_targets)
        positions       list<int32>, the student's target positions t
        topk_ids        list<int32>, len(positions) * k, row-major (position, rank)
        topk_logprobs   list<float16>, the same layout

OUT defaults to CORPUS/teacher_logits, beside CORPUS/train (outside the split directories, so the corpus's own
manifest check finds no foreign shard). Storage: a target token costs k * (4 + 2) bytes before compression: k=32 ->
192 B, k=64 -> 384 B; 1e9 target tokens at k=32 -> 192 GB. The full fp16 distribution over Qwen3's 151,936-row
vocabulary would be 303,872 B per token (~1,600x more). Only target tokens are stored, not prompts or memory.

Rows the teacher cannot score are kept as rows with empty positions and their reason, and counted in the manifest
by reason, never dropped silently; rows whose memory did not all fit the teacher's memory budget are scored (the
teacher sees whole chunks up to the budget, as it did in training) and counted as `memory_truncated_rows` (for a
`rag` teacher that is every row with more chunks than rag_k, by design).

Training joins these entries to the packed rows by row id (pipelines.data.teacher_targets; a worker reads only
the teacher shards of its own row groups), and pipelines.train.distill is the loss. `logits_match` says whether a
directory already holds this teacher's logits of this corpus at this k, so stage 4 computes them only once.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from models.awareness import CONFIG_NAME, WEIGHTS_NAME, AwarenessConfig, AwarenessModel
from pipelines.data.batch_inference import DTYPES, actor_dtype, items_dataset, map_with_actors
from pipelines.data.memory_modes import MemoryMode, memory_into_prompt, read_system, system_mode
from pipelines.data.teacher_targets import unit_items, write_scored
from pipelines.format.rows import IGNORE
from pipelines.format.shards import MANIFEST, Unit, check_split, shard_record, split_units

ID_BYTES, LOGPROB_BYTES = 4, 2  # int32 ids, float16 log-probs
READ_COLUMNS = ["input_ids", "labels", "memory_input_ids"]


def bytes_per_target_token(k: int) -> int:
    """What one target token costs in storage before compression: k ids (int32) and k log-probs (float16)."""
    return k * (ID_BYTES + LOGPROB_BYTES)


@dataclass
class TeacherLogitsConfig:
    teacher: str = ""  # an export whose system.json reads memory in its prompt (in_context or rag)
    split: str = ""  # a corpus split directory (CORPUS/train) with CORPUS/manifest.json beside it
    out: str | None = None  # None: CORPUS/teacher_logits, beside the corpus's shards
    k: int = 32  # top-k ids and log-probs kept per target token (32-64: k * 6 bytes per token)
    max_tokens: int | None = None  # the teacher's budget for a whole row (memory + prompt + target); None: its
    # decoder's max_position_embeddings. Longer rows are skipped as too_long and counted.
    batch_rows: int = 4  # rows per teacher forward (right-padded)
    actors: int = 1  # Ray Data actors, each holding the teacher
    cpus_per_actor: float = 1.0
    use_gpu: bool = False  # one GPU per actor
    dtype: str | None = None  # float32 | bfloat16 | float16; None: bfloat16 on GPU, float32 on CPU

    def problems(self) -> list[str]:
        p = []
        if not self.teacher:
            p.append("teacher: name the teacher's export: --teacher EXPORT_DIR (system.json memory in_context or rag)")
        elif not (Path(self.teacher) / CONFIG_NAME).is_file():
            p.append(f"teacher {self.teacher} is not an export (no {CONFIG_NAME})")
        elif not system_mode(read_system(self.teacher)).in_prompt:
            p.append(f"teacher {self.teacher} reads its memory as {read_system(self.teacher).get('memory')!r}; the "
                     f"teacher must read it in its prompt (system.json memory in_context or rag)")
        if not self.split:
            p.append("split: name the corpus split to score: --split CORPUS/train")
        if self.k <= 0:
            p.append(f"k must be positive (32-64 is the intended range), got {self.k}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            p.append("max_tokens must be positive or none")
        p += [f"{name} must be positive" for name in ("batch_rows", "actors") if getattr(self, name) <= 0]
        if self.dtype is not None and self.dtype not in DTYPES:
            p.append(f"dtype must be one of {sorted(DTYPES)} or none, got {self.dtype!r}")
        return p

    def out_dir(self) -> Path:
        return Path(self.out) if self.out else Path(self.split).resolve().parent / "teacher_logits"


# ---------------------------------------------------------------------------------------------- one row
def target_positions(labels: list[int]) -> list[int]:
    """The student's target positions: labels[t] != -100, t >= 1 (position 0 has no prediction before it)."""
    return [t for t, label in enumerate(labels) if label != IGNORE and t >= 1]


def teacher_row(row: dict[str, Any], mode: MemoryMode) -> tuple[list[int], int]:
    """The teacher's input ids for a corpus row, and `shift`: the memory tokens prepended to the student's row."""
    read = memory_into_prompt({**row, "input_ids": list(row["input_ids"]), "labels": list(row["labels"])}, mode)
    return list(read["input_ids"]), len(read["input_ids"]) - len(row["input_ids"])


def skip_reason(teacher_tokens: int, positions: list[int], max_tokens: int) -> str:
    if not positions:
        return "no_targets"
    if teacher_tokens > max_tokens:
        return "too_long"
    return ""


@torch.no_grad()
def top_k_at(model, sequences: list[list[int]], keep: list[list[int]], k: int,
             chunk: int = 1024) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each sequence, the top-k (ids int32, log-probs float16), each (len(keep[i]), k), of the model's next-token
    distribution at the positions keep[i]. Right-padded batch; logits are projected at the kept positions only."""
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    wanted = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, (sequence, positions) in enumerate(zip(sequences, keep, strict=True)):
        input_ids[i, : len(sequence)], attention_mask[i, : len(sequence)] = torch.tensor(sequence), 1
        wanted[i, positions] = True
    logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                   logits_to_keep=wanted.to(device), use_cache=False).logits  # (N kept, V), row-major
    ids, logprobs = [], []
    for start in range(0, logits.shape[0], chunk):  # log-softmax in float32 a slice at a time
        values, indices = logits[start : start + chunk].float().log_softmax(-1).topk(k, dim=-1)  # (n, k)
        ids.append(indices.to(torch.int32).cpu())
        logprobs.append(values.to(torch.float16).cpu())
    ids_all, logprobs_all = torch.cat(ids).numpy(), torch.cat(logprobs).numpy()
    counts = np.cumsum([0] + [len(p) for p in keep])
    return [(ids_all[a:b], logprobs_all[a:b]) for a, b in zip(counts[:-1], counts[1:])]


def score_rows(model, rows: list[dict[str, Any]], mode: MemoryMode, *, k: int, max_tokens: int,
               batch_rows: int = 4) -> list[dict[str, Any]]:
    """One output row per corpus row (in order): its id, skip reason, the student's target positions and the
    teacher's top-k there (flat, position-major), plus `memory_truncated` and `targets` for the manifest."""
    out, pending = [], []
    for row in rows:
        sequence, shift = teacher_row(row, mode)
        positions = target_positions(list(row["labels"]))
        reason = skip_reason(len(sequence), positions, max_tokens)
        memory = sum(len(chunk) for chunk in row.get("memory_input_ids") or [])
        out.append({"id": int(row.get("id", len(out))), "skipped": reason, "positions": [] if reason else positions,
                    "topk_ids": [], "topk_logprobs": [], "memory_truncated": shift < memory})
        if not reason:
            pending.append((len(out) - 1, sequence, [t + shift - 1 for t in positions]))
    for start in range(0, len(pending), batch_rows):
        batch = pending[start : start + batch_rows]
        scored = top_k_at(model, [s for _, s, _ in batch], [p for _, _, p in batch], k)
        for (index, _, _), (ids, logprobs) in zip(batch, scored, strict=True):
            out[index]["topk_ids"], out[index]["topk_logprobs"] = ids.reshape(-1), logprobs.reshape(-1)
    return out


# ---------------------------------------------------------------------------------------------- the shards
def logits_match(directory: str | Path, teacher: str | Path, k: int, split: str | Path) -> bool:
    """Whether `directory` already holds `teacher`'s top-k logits of this split, as its corpus is now."""
    manifest = Path(directory) / MANIFEST
    if not manifest.is_file():
        return False
    stored = json.loads(manifest.read_text())
    corpus = Path(split).resolve().parent
    return (stored.get("k") == k and stored.get("split") == Path(split).resolve().name
            and stored.get("teacher", {}).get("weights_sha256") == teacher_identity(teacher)["weights_sha256"]
            and stored.get("corpus_manifest_sha256") == hashlib.sha256((corpus / MANIFEST).read_bytes()).hexdigest())


def teacher_identity(export: str | Path) -> dict[str, Any]:
    """What names the teacher: its export, system.json, base decoder, and the sha256 of its saved weights."""
    export = Path(export).resolve()
    weights = export / WEIGHTS_NAME
    digest = hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else ""
    return {"export": str(export), "system": read_system(export), "decoder": AwarenessConfig.load(export).decoder,
            "weights_sha256": digest}


# ---------------------------------------------------------------------------------------------- Ray Data
class TeacherScorer:
    """A Ray Data actor holding the teacher: each batch item is one row group of the split, read here, scored, and
    written as one teacher shard; only its counts go back to the driver."""

    def __init__(self, teacher: str, k: int, max_tokens: int | None, batch_rows: int, out: str, dtype: str,
                 use_gpu: bool):
        device = "cuda" if use_gpu else "cpu"
        self.model = AwarenessModel.from_pretrained(teacher, dtype=DTYPES[dtype], device=device).eval()
        self.mode = system_mode(read_system(teacher))
        self.max_tokens = max_tokens or self.model.decoder.config.max_position_embeddings
        self.k, self.batch_rows, self.out = k, batch_rows, Path(out)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        results: dict[str, list] = {"file": [], "rows": [], "targets": [], "too_long": [], "no_targets": [],
                                    "memory_truncated": []}
        for values in zip(*(batch[key] for key in ("path", "row_group", "start", "stop", "first_id", "name"))):
            unit, name = Unit(str(values[0]), *(int(v) for v in values[1:5])), str(values[5])
            table = pq.ParquetFile(unit.path).read_row_group(unit.row_group, columns=READ_COLUMNS)
            rows = table.slice(unit.start, unit.stop - unit.start).to_pylist()
            for i, row in enumerate(rows):
                row["id"] = unit.first_id + i
            scored = score_rows(self.model, rows, self.mode, k=self.k, max_tokens=self.max_tokens,
                                batch_rows=self.batch_rows)
            write_scored(self.out / name, scored)
            results["file"].append(name)
            results["rows"].append(len(scored))
            results["targets"].append(sum(len(r["positions"]) for r in scored))
            for reason in ("too_long", "no_targets"):
                results[reason].append(sum(r["skipped"] == reason for r in scored))
            results["memory_truncated"].append(sum(bool(r["memory_truncated"]) and not r["skipped"] for r in scored))
        return results


def compute_teacher_logits(config: TeacherLogitsConfig) -> dict[str, Any]:
    """Scores every row of the split with the teacher on a Ray Data actor pool; writes the shards and the manifest,
    and returns the manifest."""
    problems = config.problems()
    if problems:
        raise ValueError("\n".join(problems))
    started = time.time()
    split = check_split(config.split)
    split_dir, out = Path(config.split).resolve(), config.out_dir().resolve()
    items = unit_items(split_dir, split_units(split, 1))
    dtype = actor_dtype(config.dtype, config.use_gpu)
    written = map_with_actors(
        items_dataset(items), TeacherScorer, actors=config.actors, batch_size=1,
        cpus_per_actor=config.cpus_per_actor, use_gpu=config.use_gpu,
        constructor_kwargs={"teacher": config.teacher, "k": config.k, "max_tokens": config.max_tokens,
                            "batch_rows": config.batch_rows, "out": str(out), "dtype": dtype,
                            "use_gpu": config.use_gpu}).take_all()
    return write_manifest(out, config, written, split.root, dtype, time.time() - started)


def write_manifest(out: Path, config: TeacherLogitsConfig, written: list[dict[str, Any]], corpus: str, dtype: str,
                   seconds: float) -> dict[str, Any]:
    shards = {w["file"]: shard_record(out / w["file"]) for w in sorted(written, key=lambda w: w["file"])}
    targets = sum(int(w["targets"]) for w in written)
    on_disk = sum(s["bytes"] for s in shards.values())
    manifest = {
        "teacher": teacher_identity(config.teacher), "k": config.k, "dtype": dtype,
        "max_tokens": config.max_tokens, "corpus": str(corpus), "split": Path(config.split).resolve().name,
        "corpus_manifest_sha256": hashlib.sha256((Path(corpus) / MANIFEST).read_bytes()).hexdigest(),
        "rows": sum(int(w["rows"]) for w in written), "target_tokens": targets,
        "skipped": {reason: sum(int(w[reason]) for w in written) for reason in ("too_long", "no_targets")},
        "memory_truncated_rows": sum(int(w["memory_truncated"]) for w in written),
        "bytes_per_target_token": bytes_per_target_token(config.k),  # k * (4 + 2), before compression
        "bytes_on_disk": on_disk, "bytes_on_disk_per_target_token": round(on_disk / targets, 1) if targets else None,
        "layout": {"ids": "int32", "logprobs": "float16 log-softmax at temperature 1", "order": "position, rank"},
        "seconds": round(seconds, 1), "shards": shards,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest
