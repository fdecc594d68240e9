"""The needle suite: RULER-style probes, each system's view of them, its answers and where gca's attention went, and
the results' arithmetic."""

from __future__ import annotations

import dataclasses
import io
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models.gca import MemoryPadding
from pipelines.data.memory_modes import MemoryMode, chunks_in_prompt, read_system
from pipelines.data.synthetic_needles import BOS, EOS, EQ, KEYS, PAD, SEP, NeedleSpec, make_example
from pipelines.evaluate.common import Progress, System, load_system
from pipelines.evaluate.efficiency import efficiency_row
from pipelines.evaluate.probes import memory_attention_probe
from pipelines.evaluate.needle import (VARIANTS, answer_budget, answer_end_loss, answer_probe, as_text,
                                       collect_with_progress, evidence_recall, is_whole_answer, make_probe,
                                       memory_attention, needle_metrics, needle_table, reread_answers,
                                       reread_end_loss, score_probe, system_prompts)
from pipelines.format.rows import IGNORE
from pipelines.train.configs.stage import ModelConfig, NeedleConfig, StageConfig
from pipelines.train.model import build_model
from pipelines.train.recipes.stage import write_system
from tests.pipelines.evaluate.test_job import export_of

SPEC = NeedleSpec()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("multiplier", [1, 16])
def test_every_answer_stands_in_its_memory_and_the_memory_has_the_asked_size(variant, multiplier):
    probe = make_probe(variant, SPEC, multiplier, seed=3, index=1, hops=3)
    assert probe.memory.shape == (SPEC.chunks * multiplier, SPEC.chunk_len)
    memory = as_text(probe.memory.ravel().tolist())
    for question, refs in zip(probe.questions, probe.references, strict=True):
        assert question[0] == BOS
        for ref in refs:
            assert as_text(ref)[:-1] in memory
        if variant in ("single", "multi_key"):
            assert as_text([question[1], EQ, *refs[0]])[:-1] in memory  # the asked key's own fact
    assert all(0 <= d < 1 for d in probe.depth)
    again = make_probe(variant, SPEC, multiplier, seed=3, index=1, hops=3)
    assert np.array_equal(again.memory, probe.memory)  # offline and deterministic: every system gets the same


def test_single_at_the_training_size_is_the_training_distribution():
    """Same memory shape, facts packed in the same number of fact chunks, questions in the same format."""
    probe = make_probe("single", SPEC, 1, seed=3, index=0)
    example = make_example(SPEC, 3, 0)
    assert probe.memory.shape == example["memory"].shape
    fact_chunks = lambda memory: sum(any(t == EQ for t in chunk) for chunk in memory)  # noqa: E731
    assert fact_chunks(probe.memory) == fact_chunks(example["memory"]) == SPEC.fact_chunks
    assert len(probe.questions) == SPEC.questions and len(probe.questions[0]) == 2


def test_variable_tracking_needs_every_hop():
    probe = make_probe("variable_tracking", SPEC, 1, seed=0, index=0, hops=3)
    memory = probe.memory.ravel().tolist()
    defined = lambda key: [i for i in range(len(memory) - 1) if memory[i] == key and memory[i + 1] == EQ]  # noqa: E731
    key = probe.questions[0][1]
    for _ in range(2):  # ka = kb ; kb = kc ; then kc = d d d
        (at,) = defined(key)
        key = memory[at + 2]
        assert key in range(100, 300)  # another key, not the value yet
    (at,) = defined(key)
    assert memory[at + 2 : at + 2 + SPEC.value_digits] == probe.references[0][0]


def test_systems_see_the_memory_where_they_read_it():
    probe = make_probe("single", SPEC, 4, seed=1, index=0)
    gca = system_prompts(probe, MemoryMode("gca"))
    assert gca["input_ids"].tolist() == probe.questions
    assert gca["memory_input_ids"].shape == (len(probe.questions), *probe.memory.shape)
    in_context = system_prompts(probe, MemoryMode("in_context"))
    assert in_context["input_ids"].shape[1] == probe.memory.size + 2 and "memory_input_ids" not in in_context
    rag = system_prompts(probe, MemoryMode("rag", rag_k=1))
    for row, question, refs in zip(rag["input_ids"].tolist(), probe.questions, probe.references, strict=True):
        assert as_text([question[1], EQ, *refs[0]])[:-1] in as_text(row[:-2])  # BM25 found the fact's chunk
    assert system_prompts(probe, MemoryMode("none"))["input_ids"].tolist() == probe.questions


def test_a_whole_answer_is_its_references_and_nothing_else():
    """RULER's string match passes an answer that holds the value and runs on (the value twice, a digit more): a
    whole answer is the references in some order, ended."""
    value, other = [11, 12, 13], [14, 15, 16]
    assert is_whole_answer([11, 12, 13], [value])
    assert not is_whole_answer([11, 12, 13, 11], [value]) and not is_whole_answer([11, 12, 13] * 2, [value])
    assert not is_whole_answer([11, 12], [value])
    assert is_whole_answer(value + other, [value, other]) and is_whole_answer(other + value, [value, other])
    assert not is_whole_answer(value, [value, other]) and not is_whole_answer(value + value, [value, other])
    key = [150]  # a two_hop answer names the key it reads next, then the value
    assert is_whole_answer(key + value, [value], key)
    assert not is_whole_answer(value, [value], key) and not is_whole_answer(value + key, [value], key)


def test_a_chain_probe_budgets_its_path_and_value():
    """Greedy decoding gets room for the keys a chain names, the value and EOS (else a right answer is cut short)."""
    spec = NeedleSpec()
    for variant, hops in [("two_hop", 2), ("three_hop", 3), ("single", 1)]:
        probe = make_probe(variant, spec, 1, seed=0, index=0)
        assert answer_budget(probe) == (hops - 1) + spec.value_digits + 1
        assert all(len(answer) == answer_budget(probe) - 1 for answer in probe.answers)


def test_needle_metrics_count_rates_intervals_and_the_heatmap():
    rows = [{"variant": "single", "multiplier": 1, "exact": e, "score": float(e), "whole": w, "depth_bin": b}
            for e, w, b in [(True, True, 0), (True, False, 0), (False, False, 1), (True, True, 1)]]
    rows += [{"variant": "multi_value", "multiplier": 4, "exact": False, "score": 0.5, "whole": False,
              "depth_bin": 0}] * 2
    for row, end in zip(rows, [0.5, 1.5, float("nan"), 1.0]):  # NaN: a served row, which shows no logits
        row["end_loss"] = end
    metrics, counts, heatmap = needle_metrics(rows, SPEC, depth_bins=2)
    assert metrics["needle/single/1x/end_loss"] == 1.0 and "needle/multi_value/4x/end_loss" not in metrics
    assert metrics["needle/single/1x"] == 0.75 and counts["needle/single/1x"] == 4
    assert metrics["needle/single/1x/whole_answer"] == 0.5 and metrics["needle/multi_value/4x/whole_answer"] == 0.0
    low, high = metrics["needle/single/1x/ci95"]
    assert low < 0.75 < high
    assert metrics["needle/multi_value/4x"] == 0.0 and metrics["needle/multi_value/4x/string_match"] == 0.5
    assert heatmap == {"memory_tokens": [SPEC.chunks * SPEC.chunk_len], "accuracy_by_depth": [[1.0], [0.5]]}
    assert needle_metrics(rows[4:], SPEC, depth_bins=2)[2] is None  # no single asked: no heatmap to draw


@pytest.mark.parametrize("memory", ["gca", "in_context", "rag", "none"])
def test_a_system_scores_probes_and_is_timed(tmp_path, checkpoint_root, memory):

    export = export_of(tmp_path, checkpoint_root, memory)
    system = load_system(memory, str(export), read_system(export))
    assert system.mode.kind == memory and system.spec == SPEC
    rows = score_probe(system, "multi_value", 4, seed=0, index=0)
    assert len(rows) == SPEC.questions and all(0 <= r["score"] <= 1 for r in rows)
    assert {r["memory_tokens"] for r in rows} == {4 * SPEC.chunks * SPEC.chunk_len}
    row = efficiency_row(system, 480, decode_tokens=3, repeats=1)
    assert row["ttft_s"] > 0 and row["decode_s_per_token"] >= 0
    assert row["prompt_tokens"] == {"gca": 2, "none": 2, "in_context": 482, "rag": 2 * SPEC.chunk_len + 2}[memory]


def test_answers_are_the_models_greedy_continuation(tmp_path, checkpoint_root):
    """A probe's answer is transformers' greedy decoding, cut at EOS, and its score is RULER's string match."""
    export = export_of(tmp_path, checkpoint_root, "gca")
    system = load_system("gca", str(export), read_system(export))
    probe = make_probe("single", SPEC, 1, seed=0, index=0)
    answers = answer_probe(system, probe)
    inputs = system_prompts(probe, system.mode)
    step = system.model(**inputs).logits[:, -1].argmax(-1)
    assert [a[0] if a else EOS for a in answers] == step.tolist()  # the first token: the argmax after the prompt
    rows = score_probe(system, "single", 1, seed=0, index=0)
    want = [float(as_text(refs[0])[:-1] in as_text(answer)) for answer, refs in zip(answers, probe.references)]
    assert [r["score"] for r in rows] == want
    assert [r["whole"] for r in rows] == [answer == list(refs[0]) for answer, refs in zip(answers, probe.references)]


ROUTED_BY_THE_QUESTION = {"memory_top_k": 1, "memory_chunk_weights": "router", "memory_lexical_routing": 100.0}


@pytest.mark.parametrize("memory, model", [("gca", {}), ("gca", ROUTED_BY_THE_QUESTION), ("rag", {})])
def test_the_end_loss_is_the_eos_loss_after_each_answer(tmp_path, checkpoint_root, memory, model):
    """answer_end_loss against full forwards: an empty answer's is the EOS loss of the prompt's next token, as
    generate's first step sees it; a longer answer's is its own row's, unpadded, whatever the other rows' lengths,
    with gca's lexical prior from the question alone (routed by it, a prior that also counted the answer's digits
    would read other chunks)."""
    export = export_of(tmp_path, checkpoint_root, memory, **model)
    system = load_system(memory, str(export), read_system(export))
    probe = make_probe("multi_value", SPEC, 2, seed=1, index=0)
    answers = [[] if q % 2 else probe.answers[q][: q % 4 + 3] for q in range(len(probe.questions))]  # 0, 3-6 tokens
    probe = dataclasses.replace(probe, answers=answers)
    losses = answer_end_loss(system, probe)
    inputs = system_prompts(probe, system.mode)
    with torch.no_grad():
        first = system.model(**inputs).logits[:, -1].float().log_softmax(-1)[:, EOS]
        for q, answer in enumerate(answers):
            alone = dataclasses.replace(probe, questions=[probe.questions[q]], answers=[answer])
            row = system_prompts(alone, system.mode)
            ids = torch.cat([row.pop("input_ids"), torch.tensor([answer + [EOS]])], 1)
            labels = ids.clone()
            labels[:, : ids.shape[1] - len(answer) - 1] = IGNORE
            want = -system.model(input_ids=ids, labels=labels, **row).logits[0, -2].float().log_softmax(-1)[EOS]
            assert losses[q] == pytest.approx(float(want), rel=1e-4, abs=1e-5)
            if not answer:
                assert losses[q] == pytest.approx(-float(first[q]), rel=1e-4, abs=1e-5)
    rows = score_probe(system, "single", 1, seed=0, index=0)
    assert all(r["end_loss"] > 0 for r in rows)


def test_memory_attention_reads_the_gca_attention_on_the_evidence_chunks(tmp_path, checkpoint_root):
    """The probed attention is the one the GCA block used (its weighted values are the block's output before o_proj),
    and the evidence chunks are where each question's facts are."""
    export = export_of(tmp_path, checkpoint_root, "gca")
    system = load_system("gca", str(export), read_system(export))
    probe = make_probe("multi_value", SPEC, 4, seed=2, index=0)
    for question, refs, evidence in zip(probe.questions, probe.references, probe.evidence, strict=True):
        text = " ".join(as_text(probe.memory[c].tolist()) for c in evidence)
        assert all(as_text([question[1], EQ, *ref])[:-1] in text for ref in refs)  # both facts, in those chunks
    read = memory_attention(system, probe)
    assert len(read) == len(probe.questions)
    assert all(0 <= r["evidence_mass"] <= 1 and r["top_chunk"] in (0.0, 1.0) for r in read)
    block = next(iter(system.model.gca_blocks().values()))
    assert not block._forward_pre_hooks  # the probe's hooks are gone again

    torch.manual_seed(0)
    hidden = torch.randn(2, 3, system.model.decoder.config.hidden_size)
    states = torch.randn(2, 5, system.model.decoder.config.hidden_size)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    memory = block.project_memory(states, MemoryPadding.from_mask(mask))
    with memory_attention_probe({0: block}) as seen:
        block(hidden, memory)
    attended = block._attend(block.input_norm(hidden), memory)
    probs = seen[0]  # (B, H, T, M)
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:-1]))
    assert float(probs[0, :, :, 3:].abs().max()) == 0.0  # padded memory gets no attention
    value = memory.value.repeat_interleave(block.num_heads // block.num_kv_heads, dim=1)  # (B, H, M, hd)
    mixed = (probs @ value).transpose(1, 2).reshape(2, 3, -1)
    assert torch.allclose(block.o_proj(mixed), attended, atol=1e-5)


def test_the_progress_line_counts_probes_with_elapsed_time_and_eta():
    now = [0.0]
    out = io.StringIO()
    progress = Progress("gca: needle", 4, every_s=30, stream=out, clock=lambda: now[0])
    rows = []
    for index in range(4):
        for question in range(3):  # a probe's questions come back together
            rows.append({"variant": "single", "multiplier": 4, "index": index, "score": 1.0})

    def arriving():
        for n, row in enumerate(rows):
            now[0] = 20.0 * (n // 3 + 1)  # a probe every 20 s
            yield row

    collected = collect_with_progress(arriving(), progress)
    assert collected == rows
    lines = out.getvalue().splitlines()
    assert lines[0] == "gca: needle  0/4 probes  elapsed 0m00s"
    assert lines[1] == "gca: needle  2/4 probes  elapsed 0m40s  eta 0m40s"  # 30 s after the last line, not sooner
    assert lines[2] == "gca: needle  4/4 probes  elapsed 1m20s" and len(lines) == 3  # and when all are done

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    on_tty = Progress("rag: needle", 2, stream=screen, clock=lambda: 10.0)
    on_tty.update(1)
    on_tty.update(2)
    first, last = "rag: needle  1/2 probes  elapsed 0m00s  eta 0m00s", "rag: needle  2/2 probes  elapsed 0m00s"
    assert screen.getvalue() == f"\r{first}\r{last.ljust(len(first))}\n"  # one line, rewritten in place


def test_probes_with_hard_distractors_and_two_token_keys(tmp_path, checkpoint_root):
    """--needle.hard_distractors puts near-identical facts in every probe (and leaves it as it was at 0); a system
    trained on two-token keys is asked two-token keys, read back from its system.json."""
    plain = make_probe("single", SPEC, 4, seed=3, index=0)
    hard = make_probe("single", SPEC, 4, seed=3, index=0, hard_distractors=0.5)
    assert np.array_equal(make_probe("single", SPEC, 4, seed=3, index=0, hard_distractors=0.0).memory, plain.memory)
    count = lambda probe: int((probe.memory == EQ).sum())  # noqa: E731
    free = 4 * SPEC.chunks * SPEC.facts_per_chunk - SPEC.facts
    assert count(plain) == SPEC.facts and count(hard) == SPEC.facts + free // 2
    needle = NeedleConfig(key_tokens=2, variants=["single:2", "multi_query"], hard_distractors=0.25)
    config = StageConfig(model=ModelConfig(pair="tiny", checkpoint_root=str(checkpoint_root), gca_layers="upper_half",
                                           gca_gate_init=0.3, decoder="full"), needle=needle)
    build_model(config.model).save_pretrained(tmp_path / "export")
    write_system(tmp_path / "export", config)
    system = load_system("gca", str(tmp_path / "export"), read_system(tmp_path / "export"))
    assert system.spec == needle.spec() and system.spec.key_tokens == 2
    rows = score_probe(system, "multi_query", 2, seed=0, index=0)
    probe = make_probe("multi_query", system.spec, 2, seed=0, index=0)
    assert all(len(q) == 1 + 2 * 2 for q in probe.questions) and len(rows) == len(probe.questions)


def test_evidence_recall_is_what_reaches_the_prompt():
    """rag's recall: BM25 finds a key named in the question and not an alias; in_context holds what fits its
    budget; gca and none put nothing in the prompt (NaN: their reading is reported otherwise)."""
    spec = NeedleSpec()
    single, aliased = (make_probe(v, spec, 16, seed=1, index=0) for v in ("single", "alias"))
    assert evidence_recall(single, MemoryMode("rag", rag_k=2)) == [1.0] * len(single.questions)
    assert sum(evidence_recall(aliased, MemoryMode("rag", rag_k=2))) <= len(aliased.questions) / 2
    assert evidence_recall(single, MemoryMode("in_context", context_budget=10**6)) == [1.0] * len(single.questions)
    first = evidence_recall(single, MemoryMode("in_context", context_budget=spec.chunk_len))  # chunk 0 only
    assert first == [float(evidence == [0]) for evidence in single.evidence]
    assert all(math.isnan(r) for kind in ("gca", "none") for r in evidence_recall(single, MemoryMode(kind)))
    rows = [{"variant": "alias", "multiplier": 16, "exact": False, "score": 0.0, "whole": False, "depth_bin": 0,
             "evidence_recall": r} for r in (1.0, 0.0, 0.0, 0.0)]
    metrics, _, _ = needle_metrics(rows, spec, depth_bins=1)
    assert metrics["needle/alias/16x/evidence_recall"] == 0.25


def test_the_needle_table_has_a_row_per_task_and_system_and_a_column_per_size():
    systems = {"gca": {"metrics": {"needle/alias/1x": 0.9, "needle/alias/1x/whole_answer": 0.85,
                                   "needle/alias/4x": 0.8, "needle/alias/4x/whole_answer": 0.75,
                                   "needle/single/1x": 1.0, "needle/single/1x/whole_answer": 1.0,
                                   "needle/alias/1x/ci95": [0.8, 0.95], "attention/alias/1x/top_chunk": 1.0}},
               "rag": {"metrics": {"needle/alias/1x": 0.5, "needle/alias/1x/whole_answer": 0.5,
                                   "needle/alias/1x/evidence_recall": 0.56}},
               "none": {"metrics": {"efficiency/ttft_s": 0.1}}}
    lines = needle_table(systems).splitlines()
    assert lines[0] == "| task | system | 1x | 4x |"
    assert lines[2:] == ["| single | gca | 1.00 / 1.00 | - |",  # the suite's task order: single before alias
                         "| alias | gca | 0.85 / 0.90 | 0.75 / 0.80 |",
                         "| alias | rag | 0.50 / 0.50 (r 0.56) | - |"]
    assert needle_table({"none": {"metrics": {}}}) == ""


class PromptReader:
    """A reader that answers only from its prompt, by hand: from the last key asked or named it follows the facts
    `k = v ;` its prompt holds, naming each key it passes, then gives the value and EOS; where the prompt holds no
    fact for a key it gives `= = =`. Batched rows come back padded; a one-row call stops where its stopping
    criteria say, checked after each token as transformers' generate does."""

    device = torch.device("cpu")

    @staticmethod
    def continuation(row: list[int]) -> list[int]:
        asked = len(row) - row[::-1].index(BOS) - 1  # the question's BOS: no memory chunk holds one
        facts, at = {}, 0
        while EQ in row[at:asked]:
            eq = row.index(EQ, at)
            sep = row.index(SEP, eq)
            facts[row[eq - 1]] = row[eq + 1 : sep]
            at = sep + 1
        key, out = [t for t in row[asked + 1 :] if t in KEYS][-1], []
        while key in facts and facts[key][0] in KEYS:  # a link: name the next key
            key = facts[key][0]
            out.append(key)
        return out + facts.get(key, [EQ, EQ, EQ]) + [EOS]

    def __call__(self, input_ids, **kwargs):
        """No opinion on where an answer ends: uniform logits, so its end loss is the log of their width."""
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, max(KEYS) + 1))

    def generate(self, input_ids, max_new_tokens, stopping_criteria=(), **kwargs):
        rows = []
        for row in input_ids.tolist():
            out = torch.tensor([row])
            for token in self.continuation(row)[:max_new_tokens]:
                out = torch.cat([out, torch.tensor([[token]])], 1)
                if any(bool(stop(out, None)[0]) for stop in stopping_criteria):
                    break
            rows.append(out[0].tolist())
        width = max(len(row) for row in rows)
        return torch.tensor([row + [PAD] * (width - len(row)) for row in rows])


def test_an_iterative_rags_end_loss_reads_what_its_training_row_holds(tmp_path, checkpoint_root):
    """reread_end_loss: where no answer names a key, the prompts are rag's, and it equals the batched answer_end_loss;
    on two_hop a row's prompt also holds the chunks of the key its answer names, so it differs from rag's, row by row
    a forward of that prompt; score_probe reports it (it was NaN)."""
    export = export_of(tmp_path, checkpoint_root, "rag")
    plain = load_system("rag", str(export), read_system(export))
    iterative = dataclasses.replace(plain, mode=dataclasses.replace(plain.mode, reread=True))
    probe = make_probe("multi_value", SPEC, 2, seed=1, index=0)
    assert reread_end_loss(iterative, probe) == pytest.approx(answer_end_loss(plain, probe), rel=1e-4, abs=1e-5)
    chain = make_probe("two_hop", SPEC, 4, seed=1, index=0)
    losses, once = reread_end_loss(iterative, chain), answer_end_loss(plain, chain)
    chunks = chain.memory.tolist()
    for loss, question, answer, evidence in zip(losses, chain.questions, chain.answers, chain.evidence, strict=True):
        kept = sorted({*chunks_in_prompt(chunks, question, plain.mode),
                       *chunks_in_prompt(chunks, [BOS, *[t for t in answer if t in KEYS]], plain.mode)})
        assert set(evidence) <= set(kept)  # both links
        ids = torch.tensor([[t for i in kept for t in chunks[i]] + question + answer])
        with torch.no_grad():
            want = -plain.model(input_ids=ids).logits[0, -1].float().log_softmax(-1)[EOS]
        assert loss == pytest.approx(float(want), rel=1e-4, abs=1e-5)
    assert any(abs(a - b) > 1e-3 for a, b in zip(losses, once))
    rows = score_probe(iterative, "two_hop", 4, seed=1, index=0)
    assert all(math.isfinite(row["end_loss"]) and row["end_loss"] > 0 for row in rows)


@pytest.mark.parametrize("variant", ["two_hop", "three_hop"])
def test_an_iterative_rag_retrieves_again_at_each_key_its_answer_names(variant):
    """With a reader that answers only from its prompt, rag answers a chain only where BM25's top 2 for the question
    hold every link (rarely, at 16x); retrieving again at each key it names, it holds every link and answers all."""
    spec = NeedleSpec()
    probe = make_probe(variant, spec, 16, seed=1, index=0)
    plain = System("rag", PromptReader(), MemoryMode("rag", rag_k=2), spec)
    iterative = dataclasses.replace(plain, mode=MemoryMode("rag", rag_k=2, reread=True))
    answers, retrieved = reread_answers(iterative, probe)
    assert answers == probe.answers  # every question, path and value
    assert evidence_recall(probe, iterative.mode, retrieved) == [1.0] * len(probe.questions)
    once = answer_probe(plain, probe)
    held = evidence_recall(probe, plain.mode)
    assert [answer == truth for answer, truth in zip(once, probe.answers)] == [bool(h) for h in held]
    assert sum(held) < len(held) / 2  # one retrieval rarely holds a chain at 16x
    rows = score_probe(iterative, variant, 16, seed=1, index=0)
    assert all(row["whole"] and row["evidence_recall"] == 1.0 for row in rows)
    assert all(row["end_loss"] == pytest.approx(math.log(max(KEYS) + 1)) for row in rows)


def test_only_a_named_retrieving_system_may_read_again():
    from pipelines.evaluate.common import Source
    from pipelines.evaluate.needle import NeedleSuite, reread_problems

    sources = [Source("rag-again", "/x", {"memory": "rag"}), Source("gca", "/y", {"memory": "gca"})]
    assert reread_problems(NeedleSuite(reread=["rag-again"]), sources) == []
    missing, gca = reread_problems(NeedleSuite(reread=["rag", "gca"]), sources)
    assert "names no system" in missing and "'gca', 'rag-again'" in missing
    assert "reads its memory as gca" in gca
    assert any("only a retriever reads again" in p for p in MemoryMode("in_context", reread=True).problems())


def test_an_export_trained_to_read_again_is_scored_reading_again():
    from pipelines.evaluate.common import Source
    from pipelines.evaluate.needle import NeedleSuite, scored_system

    trained = Source("rag-trained", "/x", {"memory": "rag", "reread": True})
    plain = Source("rag", "/y", {"memory": "rag", "reread": False})
    assert scored_system(NeedleSuite(), trained)["reread"] is True  # --needle.reread need not name it
    assert scored_system(NeedleSuite(), plain)["reread"] is False
    assert scored_system(NeedleSuite(reread=["rag"]), plain)["reread"] is True
