"""Where a worker's training examples come from: synthetic needles (stage 0's embedded default) or corpus shards
(jobs/build_corpus.py output) through Ray Data.

Both streams are positional: global step s consumes examples [s*E, (s+1)*E) of one fixed order, split by rank. So a
resumed run continues with exactly the examples it had not seen, which the index checksum in every checkpoint lets a
test count. For shards this takes Ray Data's ordered execution and every worker reading the same ordered stream
(each keeps its slice); a `streaming_split` would read each row once, but hands out blocks dynamically, so a resumed
run could not know which rows it had already trained on.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from pipelines.config import StageConfig
from pipelines.needle import make_batch
from pipelines.packing import PackingSpec, PackStats, collate_packed, pack_examples, rows_from_columns

TOKEN_COLUMNS = ["input_ids", "labels", "memory_input_ids"]


class NeedleStream:
    """Synthetic key -> value needles, example i drawn from seed (seed, i): any worker can make any example."""

    def __init__(self, config: StageConfig, rank: int, world: int):
        self.config, self.rank, self.world = config, rank, world
        self.spec = config.needle.spec()

    def batch(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], int, int]:
        """(model inputs, examples, checksum of what this worker consumed)."""
        t = self.config.train
        per_micro = t.memories_per_step // t.grad_accum
        per_rank = per_micro // self.world
        start = step * t.memories_per_step + micro * per_micro + self.rank * per_rank
        indices = list(range(start, start + per_rank))
        batch = make_batch(self.spec, self.config.needle.seed, indices)
        return {k: batch[k] for k in ("input_ids", "labels", "memory_input_ids")}, len(indices), sum(indices)

    def probe_batch(self) -> dict[str, torch.Tensor]:
        batch = make_batch(self.spec, self.config.needle.seed + 2, [self.rank])
        return {"input_ids": batch["input_ids"], "memory_input_ids": batch["memory_input_ids"]}


class CorpusStream:
    """Packed batches from the "train" dataset shard, via iter_torch_batches with a packing collate."""

    def __init__(self, config: StageConfig, rank: int, world: int, start_step: int):
        import ray.train

        self.config, self.rank, self.world = config, rank, world
        self.packing = packing_spec(config)
        self.stats = PackStats()
        self.per_micro = config.train.memories_per_step // config.train.grad_accum
        self.per_rank = self.per_micro // world
        self.shard = ray.train.get_dataset_shard("train")
        self._batches = self._iterate(skip=start_step * config.train.grad_accum)
        self._probe: dict[str, torch.Tensor] | None = None

    def _collate(self, columns: dict[str, np.ndarray]) -> dict[str, Any]:
        mine = {k: v[self.rank * self.per_rank : (self.rank + 1) * self.per_rank] for k, v in columns.items()}
        stats = PackStats()
        rows = pack_examples(rows_from_columns(mine), self.packing, stats)
        batch = collate_packed(rows, self.packing, stats)
        batch["_examples"], batch["_checksum"] = stats.examples, sum(stats.checksums)
        batch["_truncated"], batch["_rows"] = stats.truncated_tokens, stats.rows
        return batch

    def _iterate(self, skip: int) -> Iterator[dict[str, Any]]:
        epoch = 0
        while True:
            produced = 0
            for batch in self.shard.iter_torch_batches(batch_size=self.per_micro, collate_fn=self._collate,
                                                       drop_last=True):
                produced += 1
                if skip:
                    skip -= 1
                    continue
                yield batch
            if produced == 0:
                raise ValueError(
                    f"the training shards hold fewer than one batch of {self.per_micro} examples: lower "
                    f"train.memories_per_step or build a larger corpus"
                )
            epoch += 1

    def batch(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], int, int]:
        batch = next(self._batches)
        examples, checksum = batch.pop("_examples"), batch.pop("_checksum")
        self.stats.examples += examples
        self.stats.truncated_tokens += batch.pop("_truncated")
        self.stats.rows += batch.pop("_rows")
        if self._probe is None:
            self._probe = {k: v[:1] for k, v in batch.items() if k != "labels"}
        return batch, examples, checksum

    def probe_batch(self) -> dict[str, torch.Tensor]:
        if self._probe is None:
            raise RuntimeError("probe_batch before the first training batch")
        return self._probe


def packing_spec(config: StageConfig) -> PackingSpec:
    d = config.data
    return PackingSpec(max_tokens=d.max_tokens, max_chunks=d.max_chunks, chunk_len=d.chunk_len, pad_id=d.pad_id)


def corpus_datasets(config: StageConfig) -> dict[str, Any]:
    """The Ray Datasets a corpus-fed stage trains on (driver side), only the columns training reads."""
    import ray.data

    d = config.data
    datasets = {"train": _read(d.train_path, d.variants)}
    if d.val_path:
        datasets["val"] = _read(d.val_path, d.variants).limit(d.val_examples)
    return datasets


def _read(path: str, variants: str | None):
    import ray.data

    columns = TOKEN_COLUMNS + (["variant"] if variants else [])
    dataset = ray.data.read_parquet(path, columns=columns)
    if variants:
        keep = set(variants.split(","))
        dataset = dataset.filter(lambda row: row["variant"] in keep).drop_columns(["variant"])
    return dataset


def data_config():
    """Every worker reads the same, ordered stream and keeps its slice (see the module docstring)."""
    import ray.train
    from ray.data import ExecutionOptions

    return ray.train.DataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True))


@torch.no_grad()
def evaluate_corpus(model, config: StageConfig, rank: int, world: int) -> dict[str, float]:
    """Validation loss and next-token accuracy on the targets, with the memory and with it withheld: the gap is
    what reading the memory is worth."""
    import ray.train
    import torch.distributed as dist

    shard = ray.train.get_dataset_shard("val")
    if shard is None:
        return {}
    spec = packing_spec(config)
    was_training = model.training
    model.eval()
    totals = torch.zeros(5, dtype=torch.float64)  # loss sum, tokens, correct, loss sum without memory, correct
    batches = list(shard.iter_batches(batch_size=8, batch_format="numpy"))  # val_examples caps it; same on every rank
    # Under ZeRO-3 every forward gathers parameters from all ranks, so all ranks run the same number of forwards:
    # a rank without a batch of its own in the last round repeats one and does not count it.
    rounds = -(-len(batches) // world)
    for index in (r * world + rank for r in range(rounds)):
        counted = index < len(batches)
        batch = collate_packed(pack_examples(rows_from_columns(batches[index if counted else 0]), spec), spec)
        batch = {k: v.to(model.device) for k, v in batch.items()}
        labels = batch.pop("labels")
        target, valid = labels[:, 1:], labels[:, 1:] != -100
        with_memory = model(**batch).logits.float()[:, :-1]
        without = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        without = without.logits.float()[:, :-1]
        if not counted:
            continue
        totals[1] += int(valid.sum())
        for logits, loss_at, correct_at in ((with_memory, 0, 2), (without, 3, 4)):
            totals[loss_at] += float(torch.nn.functional.cross_entropy(logits[valid], target[valid], reduction="sum"))
            totals[correct_at] += int((logits.argmax(-1)[valid] == target[valid]).sum())
    model.train(was_training)
    dist.all_reduce(totals)
    tokens = max(totals[1].item(), 1)
    return {
        "val_loss": totals[0].item() / tokens,
        "token_accuracy": totals[2].item() / tokens,
        "no_memory_val_loss": totals[3].item() / tokens,
        "no_memory_token_accuracy": totals[4].item() / tokens,
    }
