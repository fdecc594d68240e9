"""What a training worker reads (pipelines/data/streams.py): a row's prompt as each memory mode's system reads it;
needle examples drawn by index, so any worker makes any example and each step's examples are dealt once over ranks
and micro-batches; corpus shards read by rank, resumable at any step with the same rows."""

from __future__ import annotations

import torch

from pipelines.data.memory_modes import GCA, MemoryMode
from pipelines.data.packing import PackingSpec
from pipelines.data.streams import (CorpusStream, NeedleStream, QuestionChunkStream, prompt_inputs, prompt_length,
                                     training_memory, validation_rows)
from pipelines.data.synthetic_needles import NeedleSpec, needle_batch
from pipelines.format.shards import load_split
from tests.pipelines.format.test_shards import token_rows, write_split

ROW = {"input_ids": [50, 51, 52, 53], "labels": [-100, -100, 52, 53], "memory_input_ids": [[7, 51], [8, 9, 10]]}


def as_lists(batch: dict[str, torch.Tensor]) -> dict[str, list]:
    return {key: value.tolist() for key, value in batch.items()}


def test_prompt_inputs_per_memory_mode():
    """gca keeps the memory for the encoder (each chunk right-padded to the longest, none cut); in_context puts every
    chunk before the prompt; rag the chunk BM25 ranks first for the prompt; none drops it. The target never comes."""
    assert as_lists(prompt_inputs(ROW, GCA)) == {"input_ids": [[50, 51]],
                                                 "memory_input_ids": [[[7, 51, 0], [8, 9, 10]]],
                                                 "memory_attention_mask": [[[1, 1, 0], [1, 1, 1]]]}
    assert as_lists(prompt_inputs(ROW, MemoryMode("in_context"))) == {"input_ids": [[7, 51, 8, 9, 10, 50, 51]]}
    assert as_lists(prompt_inputs(ROW, MemoryMode("rag", rag_k=1))) == {"input_ids": [[7, 51, 50, 51]]}  # shares 51
    assert as_lists(prompt_inputs(ROW, MemoryMode("in_context", context_budget=4))) == {"input_ids": [[7, 51, 50, 51]]}
    assert as_lists(prompt_inputs(ROW, MemoryMode("none"))) == {"input_ids": [[50, 51]]}
    assert prompt_length(ROW) == 2 and prompt_length({"labels": [-100, -100]}) == 2


SPEC = NeedleSpec()


def needles(rank: int, world: int = 2, mode: MemoryMode = GCA) -> NeedleStream:
    return NeedleStream(SPEC, 7, memories_per_step=8, grad_accum=2, rank=rank, world=world, mode=mode)


def test_needle_examples_are_dealt_by_index_once_per_step():
    """8 memories a step over 2 micro-batches and 2 ranks: 2 each, example i drawn from (seed, i) alone."""
    batch, count, checksum = needles(rank=1).batch(step=1, micro=1)
    assert (count, checksum) == (2, 14 + 15)  # 8 (step 1) + 4 (micro 1) + 2 (rank 1): examples 14 and 15
    reference = needle_batch(SPEC, 7, [14, 15])
    assert set(batch) == {"input_ids", "labels", "memory_input_ids"}
    assert all(torch.equal(batch[k], reference[k]) for k in batch)
    parts = [needles(rank).batch(1, micro)[1:] for rank in (0, 1) for micro in (0, 1)]
    assert sum(n for n, _ in parts) == 8 and sum(c for _, c in parts) == sum(range(8, 16))  # step 1: 8..15
    again, _, _ = needles(rank=1).batch(step=1, micro=1)  # another worker, or a resumed one, makes the same batch
    assert all(torch.equal(again[k], batch[k]) for k in batch)
    baseline, _, _ = needles(rank=1, mode=MemoryMode("in_context")).batch(step=1, micro=1)
    assert set(baseline) == {"input_ids", "labels"}  # a prompt-memory system gets no memory tensors


def corpus(split, rank: int, start_step: int = 0) -> CorpusStream:
    return CorpusStream(load_split(split), PackingSpec(max_tokens=64, max_chunks=4, chunk_len=8), variants=None,
                        memories_per_step=4, grad_accum=1, rank=rank, world=2, start_step=start_step)


def test_corpus_rows_by_rank_and_a_resume_reads_on_where_it_stopped(tmp_path):
    rows = token_rows(24)
    split = write_split(tmp_path, rows, files=2, row_group_rows=4)
    ranks = [corpus(split, 0), corpus(split, 1)]
    checksums = [[stream.batch(step, 0)[2] for step in range(6)] for stream in ranks]  # 6 steps x 4 rows: an epoch
    assert sum(map(sum, checksums)) == sum(range(24))  # the row ids of the whole split
    # the 6 row groups of 4 are dealt to the ranks in turn: rank 0 reads rows 0-3, 8-11, 16-19, two a step
    assert checksums[0] == [0 + 1, 2 + 3, 8 + 9, 10 + 11, 16 + 17, 18 + 19]
    resumed = corpus(split, 1, start_step=2)
    assert resumed.batch(2, 0)[2] == checksums[1][2]
    unbroken = corpus(split, 1)
    batches = [unbroken.batch(step, 0)[0] for step in range(3)]
    again = corpus(split, 1, start_step=2).batch(2, 0)[0]
    assert all(torch.equal(again[k], batches[2][k]) for k in again)
    probe = unbroken.probe_batch()  # the first batch's first row, without its labels
    assert "labels" not in probe and torch.equal(probe["input_ids"], batches[0]["input_ids"][:1])
    first = corpus(split, 0)
    try:
        first.probe_batch()
    except RuntimeError as error:
        assert "before the first training batch" in str(error)
    else:
        raise AssertionError("probe_batch before any batch must refuse")
    head = validation_rows(str(split), None, limit=5)
    assert [r["input_ids"] for r in head] == [r["input_ids"] for r in rows[:5]]


def test_question_chunk_batches_mark_each_questions_own_evidence():
    """The retriever's batch: every question against every chunk of the micro-batch, positive exactly on the chunks
    its own memory's evidence lies in (offset by the memories before it); a two_hop question's two chunks both."""
    spec = NeedleSpec(variants=("single", "alias", "two_hop"))
    stream = QuestionChunkStream(spec, 3, memories_per_step=8, grad_accum=2, rank=1, world=2)
    batch, count, checksum = stream.batch(step=2, micro=1)
    indices = [2 * 8 + 4 + 2, 2 * 8 + 4 + 3]  # step 2, micro-batch 1 (4 memories), rank 1's two
    assert (count, checksum) == (2, sum(indices))
    memories = [training_memory(spec, 3, index) for index in indices]
    chunks = [c for memory in memories for c in memory.memory.tolist()]
    assert batch["chunk_ids"].tolist() == chunks and bool(batch["chunk_mask"].all())
    row = 0
    for m, memory in enumerate(memories):
        for question, evidence in zip(memory.questions, memory.evidence, strict=True):
            assert batch["query_ids"][row, : len(question)].tolist() == question
            assert batch["query_mask"][row].sum() == len(question)
            assert batch["positives"][row].nonzero().flatten().tolist() == [m * spec.chunks + e for e in evidence]
            row += 1
    assert row == batch["positives"].shape[0]
    kinds = {training_memory(spec, 3, index).variant for index in range(40)}
    assert kinds == {"single", "alias", "two_hop"}
    two_hop = next(memory for index in range(40) if (memory := training_memory(spec, 3, index)).variant == "two_hop")
    assert all(len(evidence) == 2 for evidence in two_hop.evidence)
    again, _, _ = QuestionChunkStream(spec, 3, memories_per_step=8, grad_accum=2, rank=1, world=2).batch(2, 1)
    assert all(torch.equal(again[k], batch[k]) for k in batch)  # any worker makes any step's batch, as a resume does
