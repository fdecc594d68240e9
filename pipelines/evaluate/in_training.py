"""The evaluation the training recipes run on their validation data (pipelines.train.recipes.stage), on every rank:

- needles: exact-match accuracy with the memory and with it withheld, by depth and memory size;
- corpus: validation loss and next-token accuracy with the memory and with it withheld.

The distributed functions score this worker's share of the held-out data and sum the counts over all workers.
The evaluation suites of jobs/evaluate.py, which score finished exports side by side, are the other modules here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models import AwarenessModel
from pipelines.data.memory_modes import GCA, NO_MEMORY, MemoryMode
from pipelines.data.packing import PackingSpec
from pipelines.data.streams import collate_memory_mode
from pipelines.data.synthetic_needles import CHAIN_HOPS, GROWING_VARIANTS, NeedleSpec, needle_batch
from pipelines.evaluate.collectives import summed_over_ranks
from pipelines.format.rows import IGNORE


@dataclass
class NeedleScores:
    correct: int
    total: int
    loss_sum: float  # summed answer-token cross-entropy
    tokens: int
    depth_correct: list[int]  # per depth bin
    depth_total: list[int]

    @property
    def accuracy(self) -> float:
        return self.correct / max(self.total, 1)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.correct, self.total, self.loss_sum, self.tokens, *self.depth_correct,
                             *self.depth_total], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, bins: int) -> "NeedleScores":
        v = t.tolist()
        return cls(int(v[0]), int(v[1]), v[2], int(v[3]), [int(x) for x in v[4 : 4 + bins]],
                   [int(x) for x in v[4 + bins :]])


@torch.no_grad()
def score_needles(
    model: AwarenessModel,
    spec: NeedleSpec,
    seed: int,
    indices: list[int],
    *,
    mode: MemoryMode = GCA,
    batch_memories: int = 16,
    depth_bins: int = 4,
    variant: str = "single",
    scale: int = 1,
) -> NeedleScores:
    """Exact match of all answer tokens of `variant`'s questions and the EOS after them (a whole answer, as
    jobs/evaluate.py's whole_answer counts it; multi_value's two values in either order) on memories
    `scale` times the base size, for the system that reads its memory as `mode` says (NO_MEMORY: withheld), one
    question a row as jobs/evaluate.py asks (an in_context row holds the memory and one question, so no answer follows
    from the ones before it). Teacher-forced argmax at each answer position equals greedy decoding for exact match:
    greedy emits the right tokens exactly when each is the argmax given the right ones before it."""
    was_training = model.training
    model.eval()
    device = model.device
    scores = NeedleScores(0, 0, 0.0, 0, [0] * depth_bins, [0] * depth_bins)
    for start in range(0, len(indices), batch_memories):
        batch = needle_batch(spec, seed, indices[start : start + batch_memories], mode, scale=scale,
                             variant=variant, questions_per_row=1)
        ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
        memory = batch["memory_input_ids"].to(device) if "memory_input_ids" in batch else None
        # labels say which tokens are the question (lexical routing's prior reads the question, not the answer)
        logits = model(input_ids=ids, memory_input_ids=memory, labels=labels).logits.float()  # (rows, T, V)
        rows = batch["answer_rows"].to(device)[:, None]  # (Q, 1)
        positions = batch["answer_positions"].to(device)  # (Q, D)
        predicted = logits[rows, positions - 1].argmax(-1)  # the logits before each token predict it: (Q, D)
        exact = (predicted == ids[rows, positions]).all(-1).cpu()
        missed = ~exact
        if variant == "multi_value" and missed.any():  # either order, as the suite scores it (below)
            exact[missed] = _exact_in_the_other_order(model, ids, memory, labels, rows[missed.to(device)],
                                                      positions[missed.to(device)])
        scores.correct += int(exact.sum())
        scores.total += exact.numel()
        shifted_labels = labels[:, 1:]
        valid = shifted_labels != IGNORE
        token_loss = torch.nn.functional.cross_entropy(
            logits[:, :-1][valid], shifted_labels[valid], reduction="sum"
        )
        scores.loss_sum += float(token_loss)
        scores.tokens += int(valid.sum())
        bins = (batch["depth"] * depth_bins).long().clamp(max=depth_bins - 1)
        for b, ok in zip(bins.tolist(), exact.tolist(), strict=True):
            scores.depth_total[b] += 1
            scores.depth_correct[b] += int(ok)
    model.train(was_training)
    return scores


def _exact_in_the_other_order(model, ids, memory, labels, rows, positions) -> torch.Tensor:
    """multi_value's two values teacher-forced in the other order, for the questions missed in the trained order: (Q,)
    bool. The target holds them in needle.value_order, and jobs/evaluate.py takes them in either (RULER's
    string_match_all: every reference in the answer); a read of chunks that does not see their order would otherwise
    score about half of what the suite gives it. Only the rows holding these questions run again."""
    picked, local = rows[:, 0].unique(return_inverse=True)  # the batch rows that hold them, and each one's place
    local = local[:, None]
    values = positions[:, :-1]  # the EOS stays last
    half = values.shape[1] // 2
    other = ids[picked].clone()
    other[local, values] = ids[rows, torch.cat([values[:, half:], values[:, :half]], dim=1)]
    # row i of the batch reads memory i // r (a memory's questions share its encoder pass): each picked row its own
    read = None if memory is None else memory[picked // (len(ids) // len(memory))]
    logits = model(input_ids=other, memory_input_ids=read, labels=labels[picked]).logits
    return (logits[local, positions - 1].argmax(-1) == other[local, positions]).all(-1).cpu()


HEATMAP_DISTRACTORS = (0, 2, 6, 14)  # memory sizes for the final needle heatmap, in filler chunks added


def _summed(scores: NeedleScores) -> NeedleScores:
    total = summed_over_ranks(scores.as_tensor())
    return NeedleScores.from_tensor(total, bins=len(scores.depth_total))


def base_task(spec: NeedleSpec) -> NeedleSpec:
    """The task jobs/evaluate.py's `single` probes ask at 1x: the spec without hard distractors."""
    return dataclasses.replace(spec, hard_distractors=0.0)


def evaluate_needles(model: AwarenessModel, spec: NeedleSpec, seed: int, val_memories: int, rank: int,
                     world: int, mode: MemoryMode = GCA) -> dict[str, float]:
    """Held-out needles (memories `seed`, 0..val_memories-1), with the memory (read as `mode` says) and with it
    withheld: `needle_accuracy` is the single task at the base size (jobs/evaluate.py's needle/single/1x), one
    question a row. A run trained on more adds, with the memory: each other variant of its mixture
    (`needle_accuracy/<variant>`), its hard distractors (`needle_accuracy/hard`) and its largest memory
    (`needle_accuracy/<N>x`)."""
    spec = spec.scored()
    indices = list(range(rank, val_memories, world))
    metrics = {}
    for label, system in (("needle", mode), ("no_memory", NO_MEMORY)):
        scores = _summed(score_needles(model, base_task(spec), seed, indices, mode=system))
        metrics[f"{label}_accuracy"] = scores.accuracy
        metrics[f"{label}_val_loss"] = scores.loss
        if system is mode:
            for b, (c, n) in enumerate(zip(scores.depth_correct, scores.depth_total, strict=True)):
                metrics[f"needle_accuracy/depth_{b}"] = c / max(n, 1)
    largest = spec.memory_scale_max
    # at 1x, multi_key is the single task (alias_multi_key alias): they are scored at the largest size
    extra = {f"needle_accuracy/{v}": (spec, v, 1) for v in spec.mixture() if v not in ("single", *GROWING_VARIANTS)}
    if spec.hard_distractors > 0:
        extra["needle_accuracy/hard"] = (spec, "single", 1)
    if largest > 1:
        extra[f"needle_accuracy/{largest}x"] = (base_task(spec), "single", largest)
        for variant in (v for v in (*GROWING_VARIANTS, *CHAIN_HOPS) if v in spec.mixture()):  # chains grow too
            extra[f"needle_accuracy/{variant}/{largest}x"] = (spec, variant, largest)
    for name, (task, variant, scale) in extra.items():
        metrics[name] = _summed(score_needles(model, task, seed, indices, mode=mode, variant=variant,
                                              scale=scale)).accuracy
    return metrics


def base_accuracy(model: AwarenessModel, spec: NeedleSpec, seed: int, val_memories: int, rank: int, world: int,
                  mode: MemoryMode = GCA) -> float:
    """evaluate_needles' `needle_accuracy` alone (the base task's held-out whole answers), the same on every rank."""
    indices = list(range(rank, val_memories, world))
    return _summed(score_needles(model, base_task(spec), seed, indices, mode=mode)).accuracy


def needle_heatmap(model: AwarenessModel, spec: NeedleSpec, seed: int, val_memories: int, rank: int,
                   world: int, mode: MemoryMode = GCA) -> dict[str, Any]:
    """Needle accuracy by depth and memory size, on held-out memories (the needle-in-a-haystack picture)."""
    indices = list(range(rank, val_memories, world))
    columns = []
    for distractors in HEATMAP_DISTRACTORS:
        scores = _summed(score_needles(model, dataclasses.replace(base_task(spec), distractors=distractors), seed,
                                      indices, mode=mode))
        columns.append([c / max(n, 1) for c, n in zip(scores.depth_correct, scores.depth_total, strict=True)])
    sizes = [dataclasses.replace(spec, distractors=d).chunks * spec.chunk_len for d in HEATMAP_DISTRACTORS]
    return {"memory_tokens": sizes, "accuracy_by_depth": [list(row) for row in zip(*columns)]}


# ---------------------------------------------------------------------------------------------- corpus


@torch.no_grad()
def evaluate_corpus(model, rows: list[dict] | None, spec: PackingSpec, mode: MemoryMode = GCA) -> dict[str, float]:
    """Validation loss and next-token accuracy on the targets of `rows` (the same on every rank), with the memory (read
    as `mode` says) and with it withheld: the gap is what reading the memory is worth. Without a process group (a
    reloaded export, outside DeepSpeed) one process evaluates them all."""
    if rows is None:
        return {}
    distributed = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    was_training = model.training
    model.eval()
    totals = torch.zeros(5, dtype=torch.float64)  # loss sum, tokens, correct, loss sum without memory, correct
    batches = [rows[i : i + 8] for i in range(0, len(rows), 8)]  # data.val_examples caps them
    # Under ZeRO-3 every forward gathers parameters from all ranks, so all ranks run the same number of forwards:
    # a rank without a batch of its own in the last round repeats one and does not count it.
    rounds = -(-len(batches) // world)
    for index in (r * world + rank for r in range(rounds)):
        counted = index < len(batches)
        for system, loss_at, correct_at in ((mode, 0, 2), (NO_MEMORY, 3, 4)):
            batch = collate_memory_mode(batches[index if counted else 0], spec, system)
            batch = {k: v.to(model.device) for k, v in batch.items()}
            labels = batch.pop("labels")
            target, valid = labels[:, 1:], labels[:, 1:] != IGNORE
            logits = model(**batch, labels=labels, use_cache=False).logits.float()[:, :-1]
            if not counted:
                continue
            if system is mode:
                totals[1] += int(valid.sum())  # the same targets in both systems' batches
            totals[loss_at] += float(torch.nn.functional.cross_entropy(logits[valid], target[valid], reduction="sum"))
            totals[correct_at] += int((logits.argmax(-1)[valid] == target[valid]).sum())
    model.train(was_training)
    if distributed:
        totals = summed_over_ranks(totals)
    tokens = max(totals[1].item(), 1)
    return {
        "val_loss": totals[0].item() / tokens,
        "token_accuracy": totals[2].item() / tokens,
        "no_memory_val_loss": totals[3].item() / tokens,
        "no_memory_token_accuracy": totals[4].item() / tokens,
    }
