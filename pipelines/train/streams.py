"""Where a job's examples come from: a stage's, chosen by its config from the data package's streams, sized by the
train and data sections; the UL2 and traffic VLM jobs', their Ray Dataset's shard (DatasetStream)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import ray.train
import torch

from pipelines.data.packing import PackingSpec
from pipelines.data.streams import CorpusStream, NeedleStream
from pipelines.data.teacher_targets import TeacherEntries
from pipelines.format.shards import load_split
from pipelines.train.configs.common import TrainConfig
from pipelines.train.configs.stage import StageConfig


def packing_spec(config: StageConfig) -> PackingSpec:
    d = config.data
    return PackingSpec(max_tokens=d.max_tokens, max_chunks=d.max_chunks, chunk_len=d.chunk_len, pad_id=d.pad_id)


def make_stream(config: StageConfig, rank: int, world: int, start_step: int,
                teacher_logits: str | None = None) -> CorpusStream | NeedleStream:
    """This rank's part of the corpus shards when data.train_path is set, else the synthetic needles; with
    `teacher_logits` (stage 4), each batch carries the teacher's top-k for its rows."""
    t = config.train
    sizes = {"memories_per_step": t.memories_per_step, "grad_accum": t.grad_accum, "rank": rank, "world": world,
             "mode": config.model.memory_mode()}
    if config.data.train_path:
        split = load_split(config.data.train_path)
        teacher = TeacherEntries(teacher_logits, split, config.distill.k) if teacher_logits else None
        return CorpusStream(split, packing_spec(config), variants=config.data.variants, start_step=start_step,
                            teacher=teacher, **sizes)
    return NeedleStream(config.needle.spec(), config.needle.seed, **sizes)


class DatasetStream:
    """This worker's shard of the Ray Dataset "train", micro-batch by micro-batch, epoch after epoch, each batch of
    rows made tensors by `collate`; shuffled locally (seed train.seed + epoch) when given a `shuffle_buffer`. Equal
    shards and drop_last keep every worker on the same step count, as DeepSpeed's collectives need."""

    def __init__(self, train: TrainConfig, world: int, collate: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
                 shuffle_buffer: int | None = None):
        self.per_rank = train.memories_per_step // (train.grad_accum * world)
        self.batches = self._iterate(ray.train.get_dataset_shard("train"), collate, shuffle_buffer, train.seed)

    def _iterate(self, shard, collate, shuffle_buffer: int | None, seed: int) -> Iterator[dict[str, torch.Tensor]]:
        epoch = 0
        while True:
            shuffle = ({"local_shuffle_buffer_size": shuffle_buffer, "local_shuffle_seed": seed + epoch}
                       if shuffle_buffer else {})
            for rows in shard.iter_batches(batch_size=self.per_rank, drop_last=True, batch_format="numpy", **shuffle):
                yield collate(rows)
            epoch += 1

    def batch(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], int, int]:
        return next(self.batches), self.per_rank, 0  # rows of a Ray Dataset carry no index to checksum
