"""Where a worker's training examples come from: synthetic needles (stage 0's embedded default) or corpus shards
(jobs/build_corpus.py output), which each worker reads itself, only its own part (pipelines.format.shards).

Both streams are positional, so a resumed run continues with exactly the examples it had not seen, which the index
checksum in every checkpoint (the sum of the example ids consumed) lets a test count. Needles: global step s consumes
examples [s*E, (s+1)*E), split by rank. Shards: the split's Parquet row groups are dealt to the ranks, and rank r's
step s consumes rows [s*G*B, (s+1)*G*B) of its own cycle over them (B rows per micro-batch, G micro-batches), so
each row is read by one worker, not by all. Ray Data's `streaming_split` also reads each row once, but hands blocks
out dynamically, so a resumed run could not know which rows it had trained on; Ray Data stays the corpus builder.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

import torch

import numpy as np

from models.retriever import padded_rows
from pipelines.data.memory_modes import GCA, MemoryMode, memory_into_prompt
from pipelines.data.packing import PackingSpec, PackStats, collate_packed, pack_examples
from pipelines.data.synthetic_needles import (NeedleMemory, NeedleSpec, draw_variant, generate_memory, make_batch,
                                              memory_scale, needle_batch)
from pipelines.data.teacher_targets import TeacherEntries, teacher_tensors
from pipelines.format.rows import IGNORE
from pipelines.format.shards import RankReader, Split, head_rows, load_split

TOKEN_COLUMNS = ["input_ids", "labels", "memory_input_ids"]


class NeedleStream:
    """Synthetic key -> value needles, example i drawn from seed (seed, i): any worker can make any example. With
    needle.memory_scale_max > 1, the memories of global micro-batch g (step * grad_accum + micro, the same on every
    rank) all hold memory_scale(spec, seed, g) times the base number of chunks, so they stack, and a resumed run
    draws the same sizes. Steps before the mixture starts ask the base task alone (NeedleSpec.at_step): at
    needle.base_steps, or at `mixture_from` where training set an earlier step (needle.base_until)."""

    def __init__(self, spec: NeedleSpec, seed: int, *, memories_per_step: int, grad_accum: int, rank: int,
                 world: int, mode: MemoryMode = GCA):
        self.spec, self.seed, self.rank, self.world, self.mode = spec, seed, rank, world, mode
        self.memories_per_step, self.grad_accum = memories_per_step, grad_accum
        self.mixture_from: int | None = None

    def batch(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], int, int]:
        """(model inputs, examples, checksum of what this worker consumed)."""
        spec, indices, scale = self.draw(step, micro)
        batch = needle_batch(spec, self.seed, indices, self.mode, scale=scale)
        keys = ("input_ids", "labels", "memory_input_ids") if self.mode.kind == "gca" else ("input_ids", "labels")
        return {k: batch[k] for k in keys}, len(indices), sum(indices)

    def draw(self, step: int, micro: int) -> tuple[NeedleSpec, list[int], int]:
        """The task this micro-batch asks, the indices of this rank's examples and their memories' size."""
        per_micro = self.memories_per_step // self.grad_accum
        per_rank = per_micro // self.world
        start = step * self.memories_per_step + micro * per_micro + self.rank * per_rank
        spec = self.spec.at_step(step, self.mixture_from)  # the base task alone until the mixture starts
        return spec, list(range(start, start + per_rank)), memory_scale(spec, self.seed, step * self.grad_accum + micro)

    def probe_batch(self) -> dict[str, torch.Tensor]:
        batch = make_batch(self.spec, self.seed + 2, [self.rank])
        return {"input_ids": batch["input_ids"], "memory_input_ids": batch["memory_input_ids"]}


class QuestionChunkStream(NeedleStream):
    """The dense retriever's training pairs (jobs/retriever.py): NeedleStream's schedule (indices, memory sizes, the
    base task first), each memory drawn as the evaluation draws its probes (generate_memory, which knows every
    question's evidence chunks), so the retriever sees the reader's task mixture."""

    def batch(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], int, int]:
        spec, indices, scale = self.draw(step, micro)
        memories = [training_memory(spec, self.seed, index, scale) for index in indices]
        return question_chunk_batch(memories), len(indices), sum(indices)


def training_memory(spec: NeedleSpec, seed: int, index: int, scale: int = 1) -> NeedleMemory:
    """Memory `index` of the spec's mixture, with its questions' evidence chunks (its task: .variant)."""
    variant, hops = draw_variant(spec, seed, index)
    return generate_memory(variant, spec, scale, np.random.default_rng([seed, index]), hops,
                                    spec.hard_distractors)


def question_chunk_batch(memories: list[NeedleMemory]) -> dict[str, torch.Tensor]:
    """Every question of the memories against every chunk of them: query_ids/query_mask (Q, prompt), chunk_ids/
    chunk_mask (C, chunk_len) and positives (Q, C), true on the question's own evidence chunks."""
    questions = [q for memory in memories for q in memory.questions]
    chunks = [c for memory in memories for c in memory.memory.tolist()]
    positives = torch.zeros(len(questions), len(chunks), dtype=torch.bool)
    row, offset = 0, 0
    for memory in memories:
        for evidence in memory.evidence:
            positives[row, [offset + e for e in evidence]] = True
            row += 1
        offset += len(memory.memory)
    (query_ids, query_mask), (chunk_ids, chunk_mask) = padded_rows(questions), padded_rows(chunks)
    return {"query_ids": query_ids, "query_mask": query_mask, "chunk_ids": chunk_ids, "chunk_mask": chunk_mask,
            "positives": positives}


class CorpusStream:
    """Packed micro-batches of this rank's own rows of the training split (pipelines.format.shards), from the position
    `start_step` left off at; the checksum sums the rows' global ids."""

    def __init__(self, split: Split, packing: PackingSpec, *, variants: list[str] | None, memories_per_step: int,
                 grad_accum: int, rank: int, world: int, start_step: int, mode: MemoryMode = GCA,
                 teacher: TeacherEntries | None = None):
        self.packing, self.mode, self.teacher = packing, mode, teacher
        self.stats = PackStats()
        self.per_rank = memories_per_step // (grad_accum * world)
        self.reader = RankReader(split, rank, world, columns=TOKEN_COLUMNS, variants=variants)
        self._rows = self.reader.rows(position=start_step * grad_accum * self.per_rank)
        self._probe: dict[str, torch.Tensor] | None = None

    def batch(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], int, int]:
        rows = list(islice(self._rows, self.per_rank))
        if self.teacher is None:
            batch = collate_memory_mode(rows, self.packing, self.mode, self.stats)
        else:  # stage 4 (a GCA student): the teacher's top-k joined to the packed rows by row id
            packed = pack_examples(rows, self.packing, self.stats)
            batch = collate_packed(packed, self.packing, self.stats)
            batch |= teacher_tensors(packed, self.teacher, batch["input_ids"].shape[1])
        if self._probe is None:
            self._probe = {k: v[:1] for k, v in batch.items() if k != "labels" and not k.startswith("teacher_")}
        return batch, len(rows), sum(row["id"] for row in rows)

    def probe_batch(self) -> dict[str, torch.Tensor]:
        if self._probe is None:
            raise RuntimeError("probe_batch before the first training batch")
        return self._probe


def validation_rows(path: str, variants: list[str] | None, limit: int) -> list[dict]:
    """The validation split's first `limit` rows: every rank reads them (a few row groups; evaluation splits the
    batches over ranks)."""
    return head_rows(load_split(path), columns=TOKEN_COLUMNS, variants=variants, limit=limit)


def collate_memory_mode(rows: list[dict], packing: PackingSpec, mode: MemoryMode,
                        stats: PackStats | None = None) -> dict[str, torch.Tensor]:
    """Packed batch of corpus rows as the system with memory `mode` reads them: a prompt-memory or no-memory system
    gets its chunks in the prompt (or none) and no memory tensors."""
    if mode.kind == "gca":
        return collate_packed(pack_examples(rows, packing, stats), packing, stats)
    rows = [memory_into_prompt(row, mode) for row in rows]
    batch = collate_packed(pack_examples(rows, packing, stats), packing, stats)
    return {k: v for k, v in batch.items() if not k.startswith("memory_")}


def prompt_length(row: dict[str, Any]) -> int:
    return next((i for i, label in enumerate(row["labels"]) if label != IGNORE), len(row["labels"]))


def prompt_inputs(row: dict[str, Any], mode: MemoryMode) -> dict[str, torch.Tensor]:
    """The row's prompt (1, T) as the system reads it, one row of model inputs: gca with its memory chunks for the
    encoder (each padded to the longest, none cut); in_context and rag with chunks before the prompt; none without
    (collate_memory_mode, as in training). Evaluation and stage 3 ask systems with it."""
    n = prompt_length(row)
    chunks = [list(c) for c in row["memory_input_ids"]]
    prompt = {"input_ids": list(row["input_ids"][:n]), "labels": [IGNORE] * n, "memory_input_ids": chunks}
    spec = PackingSpec(max_tokens=n + sum(map(len, chunks)), max_chunks=max(len(chunks), 1),
                       chunk_len=max(map(len, chunks), default=1))
    batch = collate_memory_mode([prompt], spec, mode)
    return {k: v for k, v in batch.items() if k in ("input_ids", "memory_input_ids", "memory_attention_mask")}
