"""Where a stage's examples come from, chosen by its config: the data package's streams, sized by the train and data
sections."""

from __future__ import annotations

from pipelines.data.packing import PackingSpec
from pipelines.data.shards import load_split
from pipelines.data.streams import CorpusStream, NeedleStream
from pipelines.data.teacher_logits import TeacherEntries
from pipelines.train.config import StageConfig


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
