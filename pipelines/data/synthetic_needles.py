"""Synthetic key -> value needles for stage 0 in token-id space, deterministic per example index.

A memory holds `facts` facts `key = d1 d2 d3 ;`, shuffled and packed into fact chunks, plus `distractors` chunks
of filler; the chunks come in random order, so each fact sits at a recorded depth. `questions` of the facts are
asked as `BOS key` with target `d1 d2 d3 EOS`. The first digit is predicted at the key token itself, so the GCA
query that finds the fact is the key's own state: asked as `BOS key =`, the decoder must first learn to carry the
key one position on, and a tiny random pair sat on the chance plateau about twice as long (both measured in
single-process runs of the stage-0 model). Example i is drawn from its own seeded generator, so any worker can
produce any example and a resumed run continues with exactly the examples it had not seen. Several questions per
memory share one encoder pass (shared/notes/needle-feasibility.md: that is what makes learning fast).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipelines.corpora.rows import IGNORE
from pipelines.data.memory_modes import GCA, MemoryMode, prompt_memory

PAD, BOS, EQ, SEP, EOS = 0, 1, 2, 3, 4
VALUES = range(10, 100)  # value tokens: a value position draws from the first `value_range` of them
DIGITS = VALUES[:10]
KEYS = range(100, 300)
FILLER = range(300, 496)  # every id stays below the tiny encoder's 496 and decoder's 512 vocabularies
PROMPT_LEN = 2  # BOS key


@dataclass(frozen=True)
class NeedleSpec:
    facts: int = 8  # key -> value facts per memory
    questions: int = 8  # questions asked per memory (<= facts)
    value_digits: int = 3  # tokens per value
    value_range: int = 10  # distinct tokens per value position (10: decimal digits; at most 90)
    chunk_len: int = 24  # tokens per chunk; facts are packed, the rest of a fact chunk is filler
    distractors: int = 2  # chunks of filler only

    @property
    def facts_per_chunk(self) -> int:
        return self.chunk_len // self.fact_len

    @property
    def fact_chunks(self) -> int:
        return -(-self.facts // max(self.facts_per_chunk, 1))

    @property
    def chunks(self) -> int:
        return self.fact_chunks + self.distractors

    @property
    def fact_len(self) -> int:
        return self.value_digits + 3  # key, '=', digits, ';'

    def problems(self) -> list[str]:
        problems = []
        if not 1 <= self.questions <= self.facts:
            problems.append(f"needle.questions ({self.questions}) must be between 1 and needle.facts ({self.facts})")
        if self.facts > len(KEYS):
            problems.append(f"needle.facts ({self.facts}) exceeds the {len(KEYS)} distinct keys")
        if self.facts_per_chunk < 1:
            problems.append(f"needle.chunk_len ({self.chunk_len}) is shorter than one fact ({self.fact_len} tokens)")
        if not 2 <= self.value_range <= len(VALUES):
            problems.append(f"needle.value_range ({self.value_range}) must be between 2 and {len(VALUES)}")
        if self.distractors < 0:
            problems.append("needle.distractors must be >= 0")
        return problems


def make_example(spec: NeedleSpec, seed: int, index: int) -> dict[str, np.ndarray]:
    """One memory with its questions: memory (chunks, chunk_len), input_ids/labels (questions, 3 + digits + 1),
    depth (questions,) = where each asked fact starts, as a fraction of the memory."""
    rng = np.random.default_rng([seed, index])
    keys = rng.choice(np.array(KEYS), size=spec.facts, replace=False)
    values = rng.choice(np.array(VALUES[: spec.value_range]), size=(spec.facts, spec.value_digits))
    memory = rng.choice(np.array(FILLER), size=(spec.chunks, spec.chunk_len))
    order = rng.permutation(spec.facts)  # facts shuffled, then packed chunk after chunk
    fact_chunk_slots = np.sort(rng.choice(spec.chunks, size=spec.fact_chunks, replace=False))
    starts = np.zeros(spec.facts, dtype=np.int64)
    for n, fact in enumerate(order):
        chunk = fact_chunk_slots[n // spec.facts_per_chunk]
        offset = (n % spec.facts_per_chunk) * spec.fact_len
        memory[chunk, offset : offset + spec.fact_len] = [keys[fact], EQ, *values[fact], SEP]
        starts[fact] = chunk * spec.chunk_len + offset
    asked = rng.choice(spec.facts, size=spec.questions, replace=False)
    prompts = np.stack([np.array([BOS, keys[f]]) for f in asked])
    targets = np.concatenate([values[asked], np.full((spec.questions, 1), EOS)], axis=1)
    input_ids = np.concatenate([prompts, targets], axis=1)
    labels = input_ids.copy()
    labels[:, : prompts.shape[1]] = IGNORE  # loss on the answer only
    return {
        "memory": memory,
        "input_ids": input_ids,
        "labels": labels,
        "depth": starts[asked] / (spec.chunks * spec.chunk_len),
    }


def make_batch(spec: NeedleSpec, seed: int, indices: list[int]) -> dict[str, torch.Tensor]:
    """Memories (B, chunks, chunk_len) and questions (B * questions, T), question rows grouped by memory, which is
    how the GCA blocks fold them onto one encoder pass."""
    examples = [make_example(spec, seed, i) for i in indices]
    return {
        "memory_input_ids": torch.from_numpy(np.stack([e["memory"] for e in examples])),
        "input_ids": torch.from_numpy(np.concatenate([e["input_ids"] for e in examples])),
        "labels": torch.from_numpy(np.concatenate([e["labels"] for e in examples])),
        "depth": torch.from_numpy(np.concatenate([e["depth"] for e in examples])),
    }


def answer_span(spec: NeedleSpec) -> slice:
    """Positions of the logits that predict the value digits (the prompt is BOS key)."""
    return slice(PROMPT_LEN - 1, PROMPT_LEN - 1 + spec.value_digits)


def needle_batch(spec: NeedleSpec, seed: int, indices: list[int], mode: MemoryMode = GCA) -> dict[str, torch.Tensor]:
    """The batch a system with memory `mode` trains and is scored on, plus where each question's value digits stand:
    `answer_rows` (Q,) and `answer_positions` (Q, value_digits), Q = memories x questions, in make_batch's order.

    gca: make_batch (memories read through the encoder). in_context: one row per memory, the memory's tokens then
    its questions one after another (they share the prefix, as GCA's questions share one encoder pass; a question
    sees the ones before it, never its own answer). rag: one row per question, its top-k chunks then the question.
    none: the questions alone."""
    digits = torch.arange(spec.value_digits)
    if mode.kind == "gca":
        batch = make_batch(spec, seed, indices)
        q = batch["input_ids"].shape[0]
        return {**batch, "answer_rows": torch.arange(q), "answer_positions": (PROMPT_LEN + digits).expand(q, -1)}
    rows: list[list[int]] = []
    labels: list[list[int]] = []
    answer_rows, answer_starts, depth = [], [], []
    for index in indices:
        example = make_example(spec, seed, index)
        chunks = example["memory"].tolist()
        depth.append(example["depth"])
        if mode.kind == "in_context":
            rows.append(prompt_memory(chunks, [], mode))
            labels.append([IGNORE] * len(rows[-1]))
        for question, target in zip(example["input_ids"].tolist(), example["labels"].tolist(), strict=True):
            if mode.kind != "in_context":
                rows.append(prompt_memory(chunks, question[:PROMPT_LEN], mode))
                labels.append([IGNORE] * len(rows[-1]))
            answer_rows.append(len(rows) - 1)
            answer_starts.append(len(rows[-1]) + PROMPT_LEN)
            rows[-1] = rows[-1] + question
            labels[-1] = labels[-1] + target
    width = max(len(r) for r in rows)  # rows are right-padded: causal attention never reads the padding
    input_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    label_ids = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (ids, labs) in enumerate(zip(rows, labels, strict=True)):
        input_ids[r, : len(ids)], label_ids[r, : len(labs)] = torch.tensor(ids), torch.tensor(labs)
    return {"input_ids": input_ids, "labels": label_ids, "depth": torch.from_numpy(np.concatenate(depth)),
            "answer_rows": torch.tensor(answer_rows), "answer_positions": torch.tensor(answer_starts)[:, None] + digits}


def noisy_copy_rows(spec: NeedleSpec, seed: int, count: int, noise: float) -> list[dict]:
    """Corpus rows (jobs/build_corpus.py's token columns) of one question each: the memory's chunks, the prompt
    `BOS key`, and a target whose value digits each are, with probability `noise`, replaced by a random digit. The
    label is one sample; the best prediction is the whole mixture (1 - noise + noise/10 on the memory's digit), which
    a teacher that has learned the task gives and a one-hot label does not (stage 4's default corpus)."""
    rows = []
    for index in range(count):
        example = make_example(spec, seed, index)
        rng = np.random.default_rng([seed, index, 1])
        input_ids, labels = example["input_ids"][0].copy(), example["labels"][0].copy()  # the first question
        digits = np.arange(PROMPT_LEN, PROMPT_LEN + spec.value_digits)
        replaced = digits[rng.random(spec.value_digits) < noise]
        input_ids[replaced] = labels[replaced] = rng.choice(np.array(VALUES[: spec.value_range]), size=len(replaced))
        rows.append({"task": "needle", "variant": "noisy_copy", "input_ids": input_ids.tolist(),
                     "labels": labels.tolist(), "memory_input_ids": example["memory"].tolist()})
    return rows
