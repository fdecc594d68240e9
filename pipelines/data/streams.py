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
import ray.data
import ray.train
import torch
from ray.data import ExecutionOptions

from pipelines.data.synthetic_needles import NeedleSpec, make_batch
from pipelines.data.packing import PackingSpec, PackStats, collate_packed, pack_examples, rows_from_columns

TOKEN_COLUMNS = ["input_ids", "labels", "memory_input_ids"]


class NeedleStream:
    """Synthetic key -> value needles, example i drawn from seed (seed, i): any worker can make any example."""

    def __init__(self, spec: NeedleSpec, seed: int, *, memories_per_step: int, grad_accum: int, rank: int,
                 world: int):
        self.spec, self.seed, self.rank, self.world = spec, seed, rank, world
        self.memories_per_step, self.grad_accum = memories_per_step, grad_accum

    def batch(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], int, int]:
        """(model inputs, examples, checksum of what this worker consumed)."""
        per_micro = self.memories_per_step // self.grad_accum
        per_rank = per_micro // self.world
        start = step * self.memories_per_step + micro * per_micro + self.rank * per_rank
        indices = list(range(start, start + per_rank))
        batch = make_batch(self.spec, self.seed, indices)
        return {k: batch[k] for k in ("input_ids", "labels", "memory_input_ids")}, len(indices), sum(indices)

    def probe_batch(self) -> dict[str, torch.Tensor]:
        batch = make_batch(self.spec, self.seed + 2, [self.rank])
        return {"input_ids": batch["input_ids"], "memory_input_ids": batch["memory_input_ids"]}


class CorpusStream:
    """Packed batches from the "train" dataset shard, via iter_torch_batches with a packing collate."""

    def __init__(self, shard, packing: PackingSpec, *, memories_per_step: int, grad_accum: int, rank: int,
                 world: int, start_step: int):
        self.rank, self.world = rank, world
        self.packing = packing
        self.stats = PackStats()
        self.per_micro = memories_per_step // grad_accum
        self.per_rank = self.per_micro // world
        self.shard = shard
        self._batches = self._iterate(skip=start_step * grad_accum)
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


def corpus_datasets(train_path: str, val_path: str | None, variants: list[str] | None,
                    val_examples: int) -> dict[str, Any]:
    """The Ray Datasets a corpus-fed stage trains on (driver side), only the columns training reads."""
    datasets = {"train": _read(train_path, variants)}
    if val_path:
        datasets["val"] = _read(val_path, variants).limit(val_examples)
    return datasets


def _read(path: str, variants: list[str] | None):
    columns = TOKEN_COLUMNS + (["variant"] if variants else [])
    dataset = ray.data.read_parquet(path, columns=columns)
    if variants:
        keep = set(variants)
        dataset = dataset.filter(lambda row: row["variant"] in keep).drop_columns(["variant"])
    return dataset


def data_config():
    """Every worker reads the same, ordered stream and keeps its slice (see the module docstring)."""
    return ray.train.DataConfig(datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True))


