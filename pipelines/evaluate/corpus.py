"""Corpus evaluation: validation loss and next-token accuracy with the memory and with it withheld."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pipelines.data.corpora.rows import IGNORE
from pipelines.data.memory_modes import GCA, NO_MEMORY, MemoryMode
from pipelines.data.packing import PackingSpec
from pipelines.data.streams import collate_memory_mode


@torch.no_grad()
def evaluate_corpus(model, rows: list[dict] | None, spec: PackingSpec, mode: MemoryMode = GCA) -> dict[str, float]:
    """Validation loss and next-token accuracy on the targets of `rows` (the same on every rank), with the memory (read
    as `mode` says) and with it withheld: the gap is what reading the memory is worth. Without a process group (a reloaded export,
    outside DeepSpeed) one process evaluates them all."""
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
            logits = model(**batch, use_cache=False).logits.float()[:, :-1]
            if not counted:
                continue
            if system is mode:
                totals[1] += int(valid.sum())  # the same targets in both systems' batches
            totals[loss_at] += float(torch.nn.functional.cross_entropy(logits[valid], target[valid], reduction="sum"))
            totals[correct_at] += int((logits.argmax(-1)[valid] == target[valid]).sum())
    model.train(was_training)
    if distributed:
        dist.all_reduce(totals)
    tokens = max(totals[1].item(), 1)
    return {
        "val_loss": totals[0].item() / tokens,
        "token_accuracy": totals[2].item() / tokens,
        "no_memory_val_loss": totals[3].item() / tokens,
        "no_memory_token_accuracy": totals[4].item() / tokens,
    }
