"""Which stream a stage's config makes (pipelines/train/streams.py), without Ray: synthetic needles without a corpus,
the rank's part of the shards with one, each sized by the train and data sections and reading the memory as the
model config says. DatasetStream (a Ray Dataset shard) runs in the UL2 and traffic jobs' tests."""

from __future__ import annotations

import dataclasses

import torch

from pipelines.data.memory_modes import MemoryMode
from pipelines.data.packing import PackingSpec
from pipelines.data.streams import CorpusStream, NeedleStream
from pipelines.data.synthetic_needles import needle_batch
from pipelines.train.configs.common import TrainConfig
from pipelines.train.configs.stage import DataConfig, ModelConfig, NeedleConfig, StageConfig
from pipelines.train.streams import make_stream, packing_spec
from tests.pipelines.format.test_shards import token_rows, write_split

CONFIG = StageConfig(model=ModelConfig(memory="rag", rag_k=3, context_budget=512),
                     needle=NeedleConfig(facts=4, questions=4, seed=99),
                     data=DataConfig(max_tokens=128, max_chunks=4, chunk_len=8, pad_id=7),
                     train=TrainConfig(memories_per_step=8, grad_accum=2))


def test_without_a_corpus_the_needles_of_the_config():
    stream = make_stream(CONFIG, rank=1, world=2, start_step=0)
    assert isinstance(stream, NeedleStream)
    assert (stream.spec, stream.seed, stream.mode) == (CONFIG.needle.spec(), 99, MemoryMode("rag", 512, 3))
    batch, count, checksum = stream.batch(step=0, micro=1)
    assert (count, checksum) == (2, 6 + 7)  # 8 a step, 4 a micro-batch, 2 a rank: examples 6 and 7
    reference = needle_batch(CONFIG.needle.spec(), 99, [6, 7], MemoryMode("rag", 512, 3))
    assert torch.equal(batch["input_ids"], reference["input_ids"]) and "memory_input_ids" not in batch


def test_with_a_corpus_this_ranks_shards_packed_as_the_data_section_says(tmp_path):
    split = write_split(tmp_path, token_rows(16), files=1, row_group_rows=4)
    config = dataclasses.replace(CONFIG, model=ModelConfig(),
                                 data=dataclasses.replace(CONFIG.data, train_path=str(split)))
    assert packing_spec(config) == PackingSpec(max_tokens=128, max_chunks=4, chunk_len=8, pad_id=7)
    stream = make_stream(config, rank=0, world=2, start_step=1)
    assert isinstance(stream, CorpusStream) and stream.per_rank == 2 and stream.mode == MemoryMode()
    batch, count, checksum = stream.batch(step=1, micro=0)
    assert count == 2 and checksum == 8 + 9  # step 1 of rank 0 (row groups 0 and 2): past rows 0-3, rows 8 and 9
    assert batch["memory_input_ids"].shape[-1] == 8  # chunk_len
