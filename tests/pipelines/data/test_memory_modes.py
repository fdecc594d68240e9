"""The baselines' inputs: where the memory goes for in_context, rag, dense_rag and none, and that the answers stay
where the scorer looks for them."""

import os
import subprocess
import sys

import pytest
import torch

from pipelines.data.memory_modes import (MemoryMode, chunks_in_prompt, chunks_in_prompt_each, evidence_held,
                                         memory_into_prompt, prompt_memories, prompt_memories_many, prompt_memory,
                                         top_chunks)
from pipelines.data.packing import PackingSpec
from pipelines.data.streams import collate_memory_mode
from pipelines.data.synthetic_needles import BOS, EQ, PROMPT_LEN, NeedleSpec, make_example, needle_batch

SPEC = NeedleSpec()
MODES = [MemoryMode(kind) for kind in ("gca", "in_context", "rag", "none")]


def test_bm25_ranks_the_chunk_holding_the_query_term_first():
    chunks = [[300, 301, 302], [150, 2, 11, 12], [303, 304], [160, 2, 13, 150]]
    assert top_chunks(chunks, [BOS, 150], k=2) == [1, 3]  # 150 is rarer relative to length in chunk 1
    assert top_chunks(chunks, [BOS, 160], k=1) == [3]
    assert top_chunks(chunks, [999], k=2) == [0, 1]  # nothing matches: ties keep memory order
    assert top_chunks([], [1], k=2) == []


def test_prompt_memory_keeps_whole_chunks_within_the_budget_in_memory_order():
    chunks = [[1, 2], [3, 0, 5], [6, 7, 8, 9]]  # unpadded, as rows carry them; id 0 is Qwen3's `!`, kept
    assert prompt_memory(chunks, [], MemoryMode("in_context")) == [1, 2, 3, 0, 5, 6, 7, 8, 9]
    assert prompt_memory(chunks, [], MemoryMode("in_context", context_budget=6)) == [1, 2, 3, 0, 5]
    assert prompt_memory(chunks, [7, 9], MemoryMode("rag", rag_k=1)) == [6, 7, 8, 9]
    assert prompt_memory(chunks, [7], MemoryMode("none")) == []


def test_a_corpus_row_gets_its_memory_in_the_prompt_with_labels_ignored():
    row = {"input_ids": [50, 51, 52, 53], "labels": [-100, -100, 52, 53], "memory_input_ids": [[7, 51], [8, 9]]}
    moved = memory_into_prompt(row, MemoryMode("rag", rag_k=1))
    assert moved["input_ids"] == [7, 51, 50, 51, 52, 53]  # the chunk sharing a term with the prompt
    assert moved["labels"] == [-100, -100, -100, -100, 52, 53]
    assert moved["memory_input_ids"] == []
    assert memory_into_prompt(row, MemoryMode("gca")) is row
    batch = collate_memory_mode([row, row], PackingSpec(max_tokens=16, chunk_len=4), MemoryMode("in_context"))
    assert not any(key.startswith("memory_") for key in batch)
    assert batch["input_ids"][0, :6].tolist() == [7, 51, 8, 9, 50, 51]
    assert int((batch["labels"] != -100).sum()) == 4  # the same targets as the GCA system's


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.kind)
def test_every_system_scores_the_same_answers(mode):
    reference = needle_batch(SPEC, 5, [0, 1, 2])
    batch = needle_batch(SPEC, 5, [0, 1, 2], mode)
    want = reference["input_ids"][reference["answer_rows"][:, None], reference["answer_positions"]]
    got = batch["input_ids"][batch["answer_rows"][:, None], batch["answer_positions"]]
    assert torch.equal(got, want)
    assert torch.equal(batch["depth"], reference["depth"])
    labelled = batch["labels"] != -100
    assert int(labelled.sum()) == 3 * SPEC.questions * (SPEC.value_digits + 1)  # digits and EOS, nothing else
    assert ("memory_input_ids" in batch) == (mode.kind == "gca")


def test_in_context_rows_hold_the_whole_memory_and_rag_rows_the_asked_fact():
    example = make_example(SPEC, 5, 0)
    in_context = needle_batch(SPEC, 5, [0], MemoryMode("in_context"))
    # questions share the memory prefix, SPEC.questions_per_row (4) to a row: 8 questions, two rows
    assert in_context["input_ids"].shape[0] == SPEC.questions // SPEC.questions_per_row == 2
    for row in in_context["input_ids"]:
        assert row[: SPEC.chunks * SPEC.chunk_len].tolist() == example["memory"].ravel().tolist()
    assert needle_batch(SPEC, 5, [0], MemoryMode("in_context"), questions_per_row=8)["input_ids"].shape[0] == 1
    rag = needle_batch(SPEC, 5, [0], MemoryMode("rag", rag_k=1))
    for row, question in zip(rag["input_ids"].tolist(), example["input_ids"].tolist(), strict=True):
        key, digits = question[1], question[PROMPT_LEN : PROMPT_LEN + SPEC.value_digits]
        retrieved = row[: SPEC.chunk_len]
        at = retrieved.index(key)
        assert retrieved[at + 1 : at + 2 + SPEC.value_digits] == [EQ, *digits]  # the fact itself, before the question
    none = needle_batch(SPEC, 5, [0], MemoryMode("none"))
    assert torch.equal(none["input_ids"], torch.from_numpy(example["input_ids"]))


def test_no_in_context_answer_follows_by_elimination():
    """A row asks fewer questions than its memory holds facts (the last of all 8 would be forced), and the
    evaluation's rows ask one each: then a row holds the memory and exactly one answer."""
    batch = needle_batch(SPEC, 5, [0, 1], MemoryMode("in_context"))
    per_row = torch.bincount(batch["answer_rows"]).tolist()
    assert max(per_row) == SPEC.questions_per_row < SPEC.facts
    one = needle_batch(SPEC, 5, [0, 1], MemoryMode("in_context"), questions_per_row=1)
    assert one["input_ids"].shape[0] == 2 * SPEC.questions and torch.equal(one["answer_rows"], torch.arange(16))
    assert [int((row != -100).sum()) for row in one["labels"]] == [SPEC.value_digits + 1] * 16


def test_memory_mode_problems_name_the_field():
    assert MemoryMode("retrieval").problems() == [
        "model.memory must be one of ('gca', 'in_context', 'rag', 'dense_rag', 'none'), got 'retrieval'"]
    assert "model.rag_k must be positive" in MemoryMode("rag", rag_k=0).problems()[0]


def test_the_rag_baseline_keeps_jax_off_the_gpu_and_out_of_processes_that_never_retrieve():
    """bm25s runs a JAX op at import when JAX is installed, and JAX then takes 75% of the GPU in that process (a
    stage job ran out of memory so on an H200), its threads making the stage driver's later forks unsafe: importing
    the module loads no bm25s, and a rag query sends JAX to the CPU unless the user chose otherwise."""
    probe = ("import os, sys, pipelines.data.memory_modes as m; assert 'bm25s' not in sys.modules; "
             "assert m.top_chunks([[1, 2], [3]], [3], 1) == [1]; print(os.environ['JAX_PLATFORMS'])")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    chosen = [subprocess.run([sys.executable, "-c", probe], env=env | extra, capture_output=True, text=True,
                             check=True).stdout.strip() for extra in ({}, {"JAX_PLATFORMS": "cuda"})]
    assert chosen == ["cpu", "cuda"]


@pytest.fixture(scope="module")
def retriever_export(checkpoint_root, tmp_path_factory):
    """A tiny retriever export (random weights): the encoder of the tiny pair, as jobs/retriever.py exports it."""
    from models import build_pair
    from models.retriever import DenseRetriever

    directory = tmp_path_factory.mktemp("retriever")
    DenseRetriever(build_pair("tiny", checkpoint_root=checkpoint_root).memory_encoder.encoder).save_pretrained(
        directory)
    return directory


def test_dense_rag_takes_the_retrievers_top_k_in_memory_order(retriever_export):
    from models.retriever import DenseRetriever

    example = make_example(SPEC, 5, 0)
    chunks, queries = example["memory"].tolist(), [q[:PROMPT_LEN] for q in example["input_ids"].tolist()]
    mode = MemoryMode("dense_rag", rag_k=2, retriever=str(retriever_export))
    scores = DenseRetriever.from_pretrained(retriever_export).scores(chunks, queries)  # the reference ranking
    want = [sorted(row.argsort(descending=True, stable=True)[:2].tolist()) for row in scores]
    assert chunks_in_prompt_each(chunks, queries, mode) == want
    assert [chunks_in_prompt(chunks, q, mode) for q in queries] == want  # one query at a time: the same chunks
    batch = needle_batch(SPEC, 5, [0], mode)  # training rows: the retrieved chunks, then the question
    for row, kept, question in zip(batch["input_ids"].tolist(), want, example["input_ids"].tolist(), strict=True):
        assert row[: len(question) + 2 * SPEC.chunk_len] == [t for i in kept for t in chunks[i]] + question


@pytest.mark.parametrize("kind", ["in_context", "rag", "none"])
def test_one_memory_asked_at_once_equals_one_question_at_a_time(kind):
    example = make_example(SPEC, 7, 1)
    chunks, queries = example["memory"].tolist(), [q[:PROMPT_LEN] for q in example["input_ids"].tolist()]
    mode = MemoryMode(kind, rag_k=1, context_budget=3 * SPEC.chunk_len)
    assert prompt_memories(chunks, queries, mode) == [prompt_memory(chunks, q, mode) for q in queries]
    assert chunks_in_prompt_each(chunks, queries, mode) == [chunks_in_prompt(chunks, q, mode) for q in queries]


def test_dense_rag_without_a_retriever_export_names_the_flag(tmp_path):
    assert any("--model.retriever" in p for p in MemoryMode("dense_rag").problems())
    assert any("retriever.json" in p for p in MemoryMode("dense_rag", retriever=str(tmp_path)).problems())


def test_evidence_is_held_only_when_every_chunk_of_it_was_kept():
    assert evidence_held([[2], [1, 3], [1, 3], []], [[0, 2], [3, 1], [1, 2], [0]]) == [True, True, False, True]
    with pytest.raises(ValueError):  # a question without its kept chunks is a bug, not a miss
        evidence_held([[1]], [])


def test_an_iterative_rag_trains_on_every_link_its_answer_names():
    """model.rag_reread: a two_hop row holds BM25's top 2 for the question and for the key its answer names (`BOS
    kb`), in memory order: every link of the chain, where one retrieval at 16x rarely holds the second."""
    spec = NeedleSpec(variants=("two_hop",))
    scale = 16
    example = make_example(spec, 5, 0, scale=scale)
    chunks = example["memory"].tolist()
    reread = needle_batch(spec, 5, [0], MemoryMode("rag", rag_k=2, reread=True), scale=scale)
    once = needle_batch(spec, 5, [0], MemoryMode("rag", rag_k=2), scale=scale)
    held_once = 0
    for row, plain, question in zip(reread["input_ids"].tolist(), once["input_ids"].tolist(),
                                    example["input_ids"].tolist(), strict=True):
        asked, named = question[:2], question[2]
        kept = sorted({*top_chunks(chunks, asked, 2), *top_chunks(chunks, [BOS, named], 2)})
        memory = [t for c in kept for t in chunks[c]]
        assert row[: len(memory) + len(question)] == memory + question
        links = [c for c in range(len(chunks)) if any(chunks[c][i : i + 2] in ([asked[1], EQ], [named, EQ])
                                                      for i in range(len(chunks[c]) - 1))]
        assert len(links) == 2 and set(links) <= set(kept)  # both links: `ka = kb ;` and `kb = d d d ;`
        held_once += set(links) <= set(top_chunks(chunks, asked, 2))
        assert plain[: 2 * spec.chunk_len] == [t for c in sorted(top_chunks(chunks, asked, 2)) for t in chunks[c]]
    assert held_once < len(example["input_ids"]) / 2


def test_rag_reread_is_a_retrievers_option_and_its_export_says_so(tmp_path):
    from pipelines.data.memory_modes import read_system, system_mode
    from pipelines.train.configs.stage import ModelConfig, StageConfig
    from pipelines.train.recipes.stage import write_system

    assert any("only a retriever reads again" in p for p in ModelConfig(rag_reread=True).problems())  # gca
    config = StageConfig(model=ModelConfig(memory="rag", rag_reread=True))
    assert not [p for p in config.model.problems() if "reread" in p]
    write_system(tmp_path, config)
    assert system_mode(read_system(tmp_path)) == MemoryMode("rag", rag_k=2, reread=True)


def test_dense_rag_over_several_memories_at_once_equals_one_memory_at_a_time(retriever_export):
    """A training batch embeds every memory's chunks and questions in one pass a side; each question still ranks
    its own memory's chunks only, as the evaluation's one memory at a time does (memories of other sizes and
    variants, so rows pad differently in the two)."""
    examples = [make_example(SPEC, 3, 0), make_example(SPEC, 3, 1, 4), make_example(SPEC, 3, 2, 2, "multi_query")]
    memories = [e["memory"].tolist() for e in examples]
    queries = [[q[: e["prompt_len"]] for q in e["input_ids"].tolist()] for e in examples]
    mode = MemoryMode("dense_rag", rag_k=2, retriever=str(retriever_export))
    assert prompt_memories_many(memories, queries, mode) == [
        prompt_memories(chunks, asked, mode) for chunks, asked in zip(memories, queries, strict=True)]
    assert [len(m) for m in memories] == [SPEC.chunks, 4 * SPEC.chunks, 2 * SPEC.chunks]
