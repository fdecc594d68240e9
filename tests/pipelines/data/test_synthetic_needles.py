import dataclasses

import numpy as np
import pytest
import torch

from pipelines.data.synthetic_needles import BOS, EOS, EQ, PROMPT_LEN, SEP, NeedleSpec, make_batch, make_example
from pipelines.format.rows import IGNORE


def test_each_asked_needle_is_in_memory_exactly_once_at_the_recorded_depth():
    spec = NeedleSpec()
    for index in range(50):
        example = make_example(spec, seed=7, index=index)
        flat = example["memory"].reshape(-1)
        for question, depth in zip(example["input_ids"], example["depth"], strict=True):
            assert question[0] == BOS and question[-1] == EOS and len(question) == PROMPT_LEN + spec.value_digits + 1
            key, digits = question[1], question[PROMPT_LEN:-1]
            where = np.flatnonzero(flat == key)
            assert len(where) == 1  # keys are never filler, and each key appears once
            start = where[0]
            assert start == round(depth * flat.size)
            assert list(flat[start : start + spec.fact_len]) == [key, EQ, *digits, SEP]


def test_examples_are_deterministic_per_index_and_differ_across_indices():
    spec = NeedleSpec()
    a, b = make_example(spec, 1, 3), make_example(spec, 1, 3)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["memory"], make_example(spec, 1, 4)["memory"])
    assert not np.array_equal(a["memory"], make_example(spec, 2, 3)["memory"])


def test_batch_groups_questions_by_memory_and_masks_prompts():
    spec = NeedleSpec(questions=3)
    batch = make_batch(spec, 0, [5, 6])
    assert batch["memory_input_ids"].shape == (2, spec.chunks, spec.chunk_len)
    assert batch["input_ids"].shape == (6, PROMPT_LEN + spec.value_digits + 1)
    assert (batch["labels"][:, :PROMPT_LEN] == IGNORE).all()
    assert (batch["labels"][:, PROMPT_LEN:] == batch["input_ids"][:, PROMPT_LEN:]).all()
    assert np.array_equal(batch["input_ids"][3:].numpy(), make_example(spec, 0, 6)["input_ids"])


@pytest.mark.parametrize(("spec", "message"), [
    (NeedleSpec(questions=9), "between 1 and needle.facts"),
    (NeedleSpec(chunk_len=5), "shorter than one fact"),
])
def test_bad_specs_are_explained(spec, message):
    assert any(message in p for p in spec.problems())


def test_value_range_sets_the_value_vocabulary():
    from pipelines.data.synthetic_needles import VALUES

    spec = NeedleSpec(value_digits=1, value_range=90)
    values = {int(q[PROMPT_LEN]) for i in range(40) for q in make_example(spec, seed=3, index=i)["input_ids"]}
    assert values <= set(VALUES) and len(values) > 60  # one token from 90: far beyond the 10 digits
    assert any("needle.value_range" in p for p in NeedleSpec(value_range=91).problems())


# ------------------------------------------------------------------ issue 26: sizes, similar facts, the mixture
from pipelines.data.synthetic_needles import (ALIAS_OF, KEYS, PAD, TRAINED_VARIANTS, VALUES, VARIANTS,  # noqa: E402
                                              draw_variant, generate_memory, memory_scale, needle_batch)


def facts_in(memory: np.ndarray) -> dict[tuple[int, ...], list[list[int]]]:
    """Every fact `key = value ;` of a memory, read chunk by chunk: key -> its values in memory order. Filler never
    holds '=' or ';'."""
    facts: dict[tuple[int, ...], list[list[int]]] = {}
    for chunk in memory.tolist():
        at = 0
        while EQ in chunk[at:]:
            eq = chunk.index(EQ, at)
            sep = chunk.index(SEP, eq)
            start = eq - 1
            while start > at and chunk[start - 1] in KEYS:
                start -= 1
            facts.setdefault(tuple(chunk[start:eq]), []).append(chunk[eq + 1 : sep])
            at = sep + 1
    return facts


def solve(variant: str, question: list[int], facts: dict, key_tokens: int) -> list[int]:
    """The answer worked out from the memory alone, as a reader would (an alias read back through ALIAS_OF)."""
    named = []  # an alias answer names the key before its value
    if variant in ("alias", "alias_multi_key"):
        key_of = {a: k for k, a in ALIAS_OF.items()}
        question = question[:1] + [key_of[a] for a in question[1:]]
        named = question[1:]
    keys = [tuple(question[1 + i * key_tokens : 1 + (i + 1) * key_tokens])
            for i in range((len(question) - 1) // key_tokens)]
    if variant == "multi_query":
        return [t for key in keys for t in facts[key][0]]
    if variant == "multi_value":
        return [t for value in facts[keys[0]] for t in value]
    (value,) = facts[keys[0]]
    path = []  # the keys a two_hop or three_hop answer names on the way (variable_tracking: RULER's value alone)
    while variant in ("variable_tracking", "two_hop", "three_hop") and tuple(value) in facts:  # a link: follow it
        path += value if variant != "variable_tracking" else []
        (value,) = facts[tuple(value)]
    return named + path + value


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("key_tokens", "scale", "hard"), [(1, 1, 0.0), (2, 3, 0.5), (1, 2, 1.0)])
def test_every_variant_row_is_answered_by_its_memory(variant, key_tokens, scale, hard):
    spec = NeedleSpec(key_tokens=key_tokens, hard_distractors=hard, hops=(2, 3))
    for index in range(6):
        example = make_example(spec, 11, index, scale=scale, variant=variant)
        assert example["memory"].shape == (spec.chunks * scale, spec.chunk_len)
        facts = facts_in(example["memory"])
        p = example["prompt_len"]
        for row, labels in zip(example["input_ids"].tolist(), example["labels"].tolist(), strict=True):
            assert row[0] == BOS and row[-1] == EOS
            assert labels[:p] == [IGNORE] * p and labels[p:] == row[p:]  # loss on the answer and EOS only
            assert row[p:-1] == solve(variant, row[:p], facts, key_tokens), (variant, row)


def test_a_multi_query_row_and_a_multi_value_row_by_hand():
    spec = NeedleSpec(facts=4, questions=2, distractors=1)
    drawn = generate_memory("multi_query", spec, 1, np.random.default_rng(0))
    facts = facts_in(drawn.memory)
    ka, kb = drawn.questions[0][1:]
    assert drawn.questions[0] == [BOS, ka, kb] and drawn.answers[0] == facts[(ka,)][0] + facts[(kb,)][0]
    drawn = generate_memory("multi_value", spec, 1, np.random.default_rng(0))
    key = drawn.questions[0][1]
    flat = drawn.memory.ravel().tolist()
    first, second = [i for i in range(len(flat) - 1) if flat[i] == key and flat[i + 1] == EQ]
    assert drawn.answers[0] == flat[first + 2 : first + 5] + flat[second + 2 : second + 5]  # memory order
    assert sorted(map(tuple, drawn.references[0])) == sorted([tuple(flat[first + 2 : first + 5]),
                                                              tuple(flat[second + 2 : second + 5])])


def test_multi_value_sorted_order_changes_only_the_trained_answer():
    """value_order "sorted": the same memory, questions and references, each answer its two values by their digits
    (a reader that sees chunks apart cannot tell memory order); the default stays memory order."""
    spec = NeedleSpec(facts=8, questions=8, distractors=1)
    in_memory = generate_memory("multi_value", spec, 2, np.random.default_rng(5))
    sorted_spec = dataclasses.replace(spec, value_order="sorted")
    by_digits = generate_memory("multi_value", sorted_spec, 2, np.random.default_rng(5))
    assert np.array_equal(in_memory.memory, by_digits.memory) and in_memory.references == by_digits.references
    flat = in_memory.memory.ravel().tolist()
    swapped = 0
    for question, answer, sorted_answer in zip(in_memory.questions, in_memory.answers, by_digits.answers, strict=True):
        starts = [i for i in range(len(flat) - 1) if flat[i] == question[1] and flat[i + 1] == EQ]
        values = [flat[s + 2 : s + 5] for s in starts]
        assert answer == values[0] + values[1] and sorted_answer == [t for v in sorted(values) for t in v]
        swapped += answer != sorted_answer
    assert 0 < swapped < len(in_memory.answers)  # the two orders differ on some questions, not all
    assert NeedleSpec(value_order="shuffled").problems() == [
        "needle.value_order must be one of ('memory', 'sorted'), got 'shuffled'"]


def test_one_value_share_leaves_some_asked_keys_one_value_in_training_only():
    """one_value_share: that share of a multi_value memory's asked keys holds one fact, answered by its value alone;
    the rest hold two. Every batch marks each row's own answer and EOS (in_context rows hold no padding between
    questions), and the evaluation's probes, built from the same spec, ask two-valued keys only."""
    from pipelines.data.memory_modes import MemoryMode
    from pipelines.evaluate.needle import make_probe

    spec = NeedleSpec(variants=("multi_value",), value_order="sorted", one_value_share=0.25)
    for index in range(6):
        drawn = generate_memory("multi_value", spec, 2, np.random.default_rng(index))
        facts, lengths = facts_in(drawn.memory), []
        for question, answer in zip(drawn.questions, drawn.answers, strict=True):
            values = facts[(question[1],)]
            assert answer == [t for v in sorted(values) for t in v]
            lengths.append(len(values))
        assert sorted(lengths) == [1, 1, 2, 2, 2, 2, 2, 2]  # round(0.25 * 8) keys with one value
    full = dataclasses.replace(spec, one_value_share=0.0)
    for index in range(3):
        probe, probe_full = make_probe("multi_value", spec, 4, 1, index), make_probe("multi_value", full, 4, 1, index)
        assert np.array_equal(probe.memory, probe_full.memory) and probe.answers == probe_full.answers
        assert all(len(refs) == 2 for refs in probe.references)
    examples = [make_example(spec, 3, i, variant="multi_value") for i in range(2)]
    answers = [row[PROMPT_LEN : row.index(EOS) + 1] for e in examples for row in e["input_ids"].tolist()]
    assert {len(a) for a in answers} == {2 * spec.value_digits + 1, spec.value_digits + 1}
    for mode in ("gca", "in_context", "rag"):
        batch = needle_batch(spec, 3, [0, 1], MemoryMode(mode), variant="multi_value")
        got = batch["input_ids"][batch["answer_rows"][:, None], batch["answer_positions"]].tolist()
        assert [row[: len(a)] for row, a in zip(got, answers, strict=True)] == answers
        assert all(set(row[len(a):]) <= {EOS} for row, a in zip(got, answers, strict=True))
        if mode == "in_context":  # padding only at a row's end
            assert all(PAD not in np.trim_zeros(np.array(row), "b") for row in batch["input_ids"].tolist())
    assert NeedleSpec(one_value_share=1.0).problems() == [
        "needle.one_value_share (1.0) is the share of a multi_value memory's asked keys holding one value: give one "
        "within [0, 1)"]


def test_mixed_examples_are_deterministic_per_index():
    spec = NeedleSpec(key_tokens=2, hard_distractors=0.5, memory_scale_max=4,
                      variants=("single:2", "multi_key", "multi_value", "multi_query", "variable_tracking"))
    for index in range(12):
        a, b = make_example(spec, 5, index, scale=2), make_example(spec, 5, index, scale=2)
        assert all(np.array_equal(a[k], b[k]) for k in a)
        assert draw_variant(spec, 5, index) == draw_variant(spec, 5, index)
    assert not np.array_equal(make_example(spec, 5, 0, scale=2)["memory"], make_example(spec, 6, 0, scale=2)["memory"])
    batch, again = make_batch(spec, 5, list(range(8)), scale=2), make_batch(spec, 5, list(range(8)), scale=2)
    assert all(torch.equal(batch[k], again[k]) for k in batch)


def test_the_mixture_draws_variants_by_weight_and_the_default_draws_nothing():
    spec = NeedleSpec(variants=("single:3", "multi_query:1"), hops=(3,))
    drawn = [draw_variant(spec, 0, i)[0] for i in range(400)]
    assert set(drawn) == {"single", "multi_query"} and 240 < drawn.count("single") < 360
    assert {draw_variant(NeedleSpec(variants=("variable_tracking",), hops=(3,)), 0, i) for i in range(5)} == {
        ("variable_tracking", 3)}
    assert {draw_variant(NeedleSpec(), 0, i) for i in range(20)} == {("single", 2)}


def test_drawn_memory_sizes_cover_the_range_once_per_micro_batch():
    spec = NeedleSpec(memory_scale_max=8)
    sizes = [memory_scale(spec, 1234, g) for g in range(2000)]
    assert set(sizes) == set(range(1, 9))
    counts = np.bincount(sizes, minlength=9)
    assert counts[1] > counts[2] > counts[8] > 0 and abs(counts[1] - (counts[2] + counts[3])) < 120  # log-uniform
    assert sizes == [memory_scale(spec, 1234, g) for g in range(2000)]  # a resumed run draws the same
    assert {memory_scale(NeedleSpec(), 1234, g) for g in range(50)} == {1}


def test_the_stream_gives_every_rank_one_size_per_micro_batch():
    from pipelines.data.streams import NeedleStream

    spec = NeedleSpec(memory_scale_max=6)
    ranks = [NeedleStream(spec, 3, memories_per_step=8, grad_accum=2, rank=r, world=2) for r in range(2)]
    seen = set()
    for step in range(12):
        for micro in range(2):
            shapes = {tuple(s.batch(step, micro)[0]["memory_input_ids"].shape) for s in ranks}
            (shape,) = shapes  # both ranks' memories have the same size, so DeepSpeed's steps stay in lockstep
            assert shape == (2, spec.chunks * memory_scale(spec, 3, step * 2 + micro), spec.chunk_len)
            seen.add(shape[1] // spec.chunks)
    assert len(seen) > 2


def test_base_steps_ask_the_default_task_first_then_the_mixture():
    from pipelines.data.streams import NeedleStream

    mixed = NeedleSpec(memory_scale_max=8, hard_distractors=0.5, variants=("single", "multi_key", "multi_query"),
                       base_steps=5)
    default = NeedleStream(NeedleSpec(), 3, memories_per_step=4, grad_accum=1, rank=0, world=1)
    stream = NeedleStream(mixed, 3, memories_per_step=4, grad_accum=1, rank=0, world=1)
    for step in range(5):  # exactly the default's examples, whatever the mixture says
        got, want = stream.batch(step, 0)[0], default.batch(step, 0)[0]
        assert all(torch.equal(got[k], want[k]) for k in want)
    after = [stream.batch(step, 0)[0] for step in range(5, 40)]
    unstaged = NeedleStream(dataclasses.replace(mixed, base_steps=0), 3, memories_per_step=4, grad_accum=1, rank=0,
                            world=1)
    for step, got in zip(range(5, 40), after, strict=True):  # from step 5 on, the mixture's own batches
        assert all(torch.equal(got[k], v) for k, v in unstaged.batch(step, 0)[0].items())
    assert {b["memory_input_ids"].shape[1] for b in after} != {NeedleSpec().chunks}  # bigger memories came
    assert mixed.base() == NeedleSpec() and mixed.at_step(4) == NeedleSpec() and mixed.at_step(5) == mixed
    assert "needle.base_steps must be >= 0" in " ".join(NeedleSpec(base_steps=-1).problems())


def test_a_mixture_started_early_draws_the_mixture_s_own_batches_from_that_step():
    """needle.base_until: training sets the stream's mixture_from where the lookup formed; from that step on the
    batches are the mixture's, before it the default's, and base_steps stays the latest start."""
    from pipelines.data.streams import NeedleStream

    mixed = NeedleSpec(memory_scale_max=8, variants=("single", "multi_key", "multi_query"), base_steps=30)
    assert mixed.at_step(10, mixture_from=12) == NeedleSpec() and mixed.at_step(12, mixture_from=12) == mixed
    assert mixed.at_step(30, mixture_from=None) == mixed and mixed.at_step(29, mixture_from=40) == NeedleSpec()
    default = NeedleStream(NeedleSpec(), 3, memories_per_step=4, grad_accum=1, rank=0, world=1)
    unstaged = NeedleStream(dataclasses.replace(mixed, base_steps=0), 3, memories_per_step=4, grad_accum=1, rank=0,
                            world=1)
    stream = NeedleStream(mixed, 3, memories_per_step=4, grad_accum=1, rank=0, world=1)
    stream.mixture_from = 12
    for step in range(30):
        got, want = stream.batch(step, 0)[0], (default if step < 12 else unstaged).batch(step, 0)[0]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), step


@pytest.mark.parametrize("key_tokens", [1, 2])
def test_hard_distractors_are_near_identical_and_never_collide_with_an_asked_key(key_tokens):
    spec = NeedleSpec(key_tokens=key_tokens, hard_distractors=0.75)
    for index in range(10):
        example = make_example(spec, 2, index, scale=2, variant="single")
        facts = facts_in(example["memory"])
        asked = {tuple(row[1 : example["prompt_len"]]): row[example["prompt_len"] : -1] for row in
                 example["input_ids"].tolist()}
        assert len(asked) == spec.questions == spec.facts  # every real fact is asked: the others are distractors
        assert all(facts[key] == [value] for key, value in asked.items())  # an asked key names one fact only
        free = spec.chunks * 2 * spec.facts_per_chunk - spec.facts
        others = [(key, values[0]) for key, values in facts.items() if key not in asked]
        assert len(others) == int(0.75 * free)
        for key, value in others:
            near = [(k, v) for k, v in asked.items()
                    if sum(a != b for a, b in zip(k, key)) == 1
                    and sum(a != b for a, b in zip(v, value)) == 1]
            assert near, (key, value)  # value one digit off; key one token off (one-token keys: another key)
            if key_tokens == 2:
                assert any(sum(a == b for a, b in zip(k, key)) == 1 for k, _ in near)  # shares a token


def test_batches_of_mixed_tasks_stack_and_say_where_each_answer_is():
    spec = NeedleSpec(variants=("single", "multi_value", "multi_query", "variable_tracking"), hops=(3,))
    indices = list(range(16))
    batch = make_batch(spec, 9, indices, scale=2)
    examples = [make_example(spec, 9, i, scale=2) for i in indices]
    drawn = {draw_variant(spec, 9, i)[0] for i in indices}
    assert drawn == {"single", "multi_value", "multi_query", "variable_tracking"}
    per_memory = batch["input_ids"].shape[0] // len(indices)
    assert per_memory == spec.questions  # the most any memory asks; fewer are padded with unlabelled PAD rows
    assert batch["memory_input_ids"].shape == (16, 2 * spec.chunks, spec.chunk_len)
    got = batch["input_ids"][batch["answer_rows"][:, None], batch["answer_positions"]]
    q = 0
    for b, e in enumerate(examples):
        for row in e["input_ids"].tolist():
            answer = row[e["prompt_len"] :]  # its tokens and EOS
            assert answer[-1] == EOS
            assert got[q, : len(answer)].tolist() == answer and set(got[q, len(answer) :].tolist()) <= {EOS}
            q += 1
        padded = batch["input_ids"][b * per_memory + len(e["input_ids"]) : (b + 1) * per_memory]
        assert (padded == PAD).all() and (batch["labels"][b * per_memory + len(e["input_ids"]) : (b + 1) * per_memory]
                                          == IGNORE).all()
    assert q == len(batch["answer_rows"]) == len(batch["depth"])
    for mode in ("in_context", "rag", "none"):
        from pipelines.data.memory_modes import MemoryMode

        other = needle_batch(spec, 9, indices, MemoryMode(mode), scale=2)
        assert torch.equal(other["input_ids"][other["answer_rows"][:, None], other["answer_positions"]], got)


def test_new_fields_are_validated():
    problems = " ".join(NeedleSpec(variants=("single", "variable_tracking"), key_tokens=2, value_digits=1).problems())
    assert "a variable_tracking link `ka = kb ;` would not fit" in problems
    assert "needle.variants is empty" in " ".join(NeedleSpec(variants=()).problems())
    assert NeedleSpec(key_tokens=2).prompt_len == 3 and NeedleSpec(key_tokens=2).fact_len == 7
    assert NeedleSpec(variants=("single", "multi_query")).longest_row == 1 + 2 + 6 + 1
    assert all(t < 496 for t in (*KEYS, *VALUES))


def test_multi_query_asks_pairs_of_an_odd_number_of_facts():
    for spec in (NeedleSpec(facts=7, questions=7), NeedleSpec(facts=5, questions=5, key_tokens=2)):
        for index in range(5):
            example = make_example(spec, 1, index, variant="multi_query")
            rows = spec.facts // 2  # a fact is left unasked
            assert example["input_ids"].shape == (rows, 1 + 2 * spec.key_tokens + 2 * spec.value_digits + 1)


def test_a_task_that_cannot_fit_the_memory_is_named():
    tight = NeedleSpec(facts=1, questions=1, value_digits=4, chunk_len=7, distractors=0,  # stage 4's memory: 1 slot
                       variants=("single", "multi_query"))
    assert tight.problems() == ["needle.variants: multi_query asks nothing in a memory of 1 fact slots: add "
                                "needle.distractors or needle.facts"]
    chained = dataclasses.replace(tight, variants=("variable_tracking",))
    assert "a 3-hop chain does not fit" in " ".join(chained.problems())
    assert not NeedleSpec(variants=TRAINED_VARIANTS).problems()


# ------------------------------------------------------------------ issue 45: questions retrieval cannot match
import hashlib  # noqa: E402

from pipelines.data.needle_tokenizer import needle_tokenizer  # noqa: E402
from pipelines.data.synthetic_needles import ALIASED_KEYS, ALIASES, CHAIN_HOPS, parse_mixture  # noqa: E402
from pipelines.evaluate.needle import make_probe  # noqa: E402

EXISTING = ("single", "multi_key", "multi_value", "multi_query", "variable_tracking")


def existing_rows_digest() -> str:
    """sha256 over the existing tasks' training examples (default and mixed specs) and evaluation probes."""
    h = hashlib.sha256()
    mixed = NeedleSpec(key_tokens=2, hard_distractors=0.5, memory_scale_max=4,
                       variants=("single:2", "multi_key", "multi_value", "multi_query", "variable_tracking"))
    for spec in (NeedleSpec(), mixed):
        for index in range(6):
            for variant in (None, *EXISTING):
                example = make_example(spec, 5, index, scale=2, variant=variant)
                for k in ("memory", "input_ids", "labels", "depth"):
                    h.update(np.ascontiguousarray(example[k]).tobytes())
    for variant in EXISTING:
        for multiplier in (1, 4):
            for hops in (2, 3):
                probe = make_probe(variant, NeedleSpec(), multiplier, 20261123, 1, hops, 0.25)
                h.update(probe.memory.tobytes())
                h.update(repr((probe.questions, probe.answers, probe.evidence, probe.depth)).encode())
    return h.hexdigest()


def test_the_existing_tasks_draw_exactly_what_they_drew_before_the_new_families():
    """Recorded from the generator at 2945d5c, before alias and the chains in chunks of their own: a trained run's
    data and every earlier evaluation's probes stay the same."""
    assert existing_rows_digest() == "2c92d294269b0b1f9af9f66042e8ec7c137a08d4ebe15cf7fa010c87f4fe566e"


def test_the_alias_map_is_one_fixed_bijection_onto_tokens_no_alias_memory_holds():
    assert sorted(ALIAS_OF) == list(ALIASED_KEYS) and sorted(ALIAS_OF.values()) == list(ALIASES)
    assert not set(ALIASES) & set(KEYS) and sum(k == a for k, a in ALIAS_OF.items()) == 0
    assert len({a - k for k, a in ALIAS_OF.items()}) > 50  # a permutation, not a shift a reader could undo by rule
    for seed in (0, 1):  # every memory obeys the same map, whatever its seed
        for index in range(4):
            example = make_example(NeedleSpec(), seed, index, variant="alias")
            facts = facts_in(example["memory"])
            for row in example["input_ids"].tolist():  # BOS alias key d d d EOS
                (key,) = [k for k, values in facts.items() if values == [row[3:-1]]]
                assert row[1] == ALIAS_OF[key[0]] and row[2] == key[0]


@pytest.mark.parametrize("variant", ["alias", "alias_multi_key"])
@pytest.mark.parametrize(("key_tokens", "scale", "hard"), [(1, 1, 0.0), (1, 16, 0.5), (2, 4, 1.0)])
def test_an_alias_question_shares_no_token_with_its_evidence_chunk(variant, key_tokens, scale, hard):
    """Not a word and not a token of the needle tokenizer (the ids words are read into): BM25 has nothing to match."""
    tokenizer = needle_tokenizer()
    tokens = lambda ids: set(tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False),  # noqa: E731
                                              add_special_tokens=False).ids)
    spec = NeedleSpec(key_tokens=key_tokens)
    for index in range(4):
        probe = make_probe(variant, spec, scale, seed=9, index=index, hard_distractors=hard)
        for question, evidence, answer, path in zip(probe.questions, probe.evidence, probe.answers, probe.paths,
                                                    strict=True):
            (chunk,) = evidence
            words = tokenizer.decode(question, skip_special_tokens=False).split()
            assert not tokens(question) & tokens(probe.memory[chunk].tolist())
            assert not set(words) & set(tokenizer.decode(probe.memory[chunk].tolist()).split())
            key_of = {a: k for k, a in ALIAS_OF.items()}
            key = [key_of[a] for a in question[1:]]
            assert path == key and answer[: len(key)] == key  # the answer names the key, then its value
            assert as_fact(key, answer[len(key) :]) in as_fact(probe.memory[chunk].tolist(), [])  # the evidence
            # holds the answer


def as_fact(key: list[int], value: list[int]) -> str:
    """Tokens as text, so `in` finds a run of them."""
    return " " + " ".join(map(str, key + ([EQ, *value, SEP] if value else []))) + " "


def follow(key: tuple[int, ...], facts: dict) -> list[int] | None:
    """The value a chain from `key` ends at, or None where a link is missing (ka's binding, or kb's)."""
    while key in facts:
        (value,) = facts[key]
        if not set(value) <= set(KEYS):  # digits: the chain's end
            return value
        key = tuple(value)
    return None


@pytest.mark.parametrize("variant", ["two_hop", "three_hop"])
@pytest.mark.parametrize(("key_tokens", "scale", "hard"), [(1, 1, 0.0), (1, 4, 0.5), (2, 16, 1.0)])
def test_a_chain_question_cannot_be_answered_without_every_one_of_its_chunks(variant, key_tokens, scale, hard):
    spec = NeedleSpec(key_tokens=key_tokens)
    for index in range(4):
        probe = make_probe(variant, spec, scale, seed=2, index=index, hard_distractors=hard)
        for question, evidence, answer, path, (value,) in zip(probe.questions, probe.evidence, probe.answers,
                                                              probe.paths, probe.references, strict=True):
            asked = tuple(question[1:])
            assert len(evidence) == CHAIN_HOPS[variant]  # every link in a chunk of its own
            assert follow(asked, facts_in(probe.memory)) == value
            assert answer == path + value and len(path) == key_tokens * (CHAIN_HOPS[variant] - 1)
            assert follow(tuple(path[-key_tokens:]), facts_in(probe.memory)) == value  # the last key named binds it
            for removed in evidence:
                rest = np.delete(probe.memory, removed, axis=0)
                assert follow(asked, facts_in(rest)) is None  # the chain breaks: nothing binds the key to a value


def test_three_hop_is_scored_and_never_trained():
    assert "three_hop" in VARIANTS and "three_hop" not in TRAINED_VARIANTS
    mixture, problems = parse_mixture(["single", "three_hop:2"])
    assert "three_hop" not in mixture and "'three_hop' is scored only" in " ".join(problems)
    assert "scored only" in " ".join(NeedleSpec(variants=("two_hop", "three_hop")).problems())
    everything = NeedleSpec(variants=TRAINED_VARIANTS)
    drawn = {draw_variant(everything, 3, i)[0] for i in range(400)}
    assert drawn == set(TRAINED_VARIANTS)  # the mixture draws every trained task, three_hop never
    from pipelines.evaluate.needle import NeedleSuite
    from pipelines.train.configs.stage import NeedleConfig

    assert "three_hop" in NeedleSuite().variants  # the evaluation scores it by default
    assert any("scored only" in p for p in NeedleConfig(variants=["three_hop"]).problems("gca", corpus=False,
                                                                                       num_workers=1))


@pytest.mark.parametrize("variant", ["alias", "alias_multi_key", "two_hop", "three_hop"])
def test_the_new_families_are_deterministic_by_seed(variant):
    spec = NeedleSpec(hard_distractors=0.5)
    a, b = make_probe(variant, spec, 4, 7, 2, hard_distractors=0.5), make_probe(variant, spec, 4, 7, 2,
                                                                                hard_distractors=0.5)
    assert np.array_equal(a.memory, b.memory) and (a.questions, a.answers, a.evidence) == (b.questions, b.answers,
                                                                                          b.evidence)
    assert not np.array_equal(a.memory, make_probe(variant, spec, 4, 8, 2, hard_distractors=0.5).memory)
    if variant != "three_hop":
        trained = dataclasses.replace(spec, variants=(variant,))
        x, y = make_example(trained, 4, 1, scale=2), make_example(trained, 4, 1, scale=2)
        assert all(np.array_equal(x[k], y[k]) for k in x)
        assert not np.array_equal(x["memory"], make_example(trained, 5, 1, scale=2)["memory"])


def test_alias_multi_key_grows_with_the_memory_and_alias_does_not():
    spec = NeedleSpec()
    count = lambda variant, scale: len(facts_in(make_probe(variant, spec, scale, 1, 0).memory))  # noqa: E731
    assert count("alias", 1) == count("alias", 8) == spec.facts
    assert count("alias_multi_key", 1) == spec.facts and count("alias_multi_key", 8) == 8 * spec.facts


def chunks_of(memory: np.ndarray) -> dict[tuple[int, ...], int]:
    """The chunk each fact's key is written in."""
    return {key: c for c, chunk in enumerate(memory) for key in facts_in(chunk[None])}


@pytest.mark.parametrize(("variant", "key_tokens"), [("two_hop", 1), ("three_hop", 1), ("two_hop", 2)])
def test_a_chain_memory_grows_with_chains_nobody_asks_each_link_in_a_chunk_of_its_own(variant, key_tokens):
    spec = NeedleSpec(key_tokens=key_tokens)
    hops = CHAIN_HOPS[variant]
    for scale in (1, 4, 16, 64):
        probe = make_probe(variant, spec, scale, seed=3, index=0)
        facts = facts_in(probe.memory)
        held = min(spec.chunks * scale * spec.facts_per_chunk, spec.key_space,
                   max(spec.questions * hops, spec.facts * scale)) // hops * hops
        assert len(facts) == held  # multi_key's growth, as many chains as the keys allow
        firsts = set(facts) - {tuple(value) for values in facts.values() for value in values}
        assert len(firsts) == held // hops  # chains, asked or not: every one ends in a value
        where = chunks_of(probe.memory)
        for first in firsts:  # every chain, asked or not, has each link in a chunk of its own
            key, seen = first, []
            while key in facts:
                seen.append(where[key])
                key = tuple(facts[key][0])
            assert len(seen) == hops and len(set(seen)) == hops
        asked = {tuple(q[1:]) for q in probe.questions}
        assert asked <= firsts and len(asked) == len(probe.questions)
        if scale >= 16:  # the asked chains are a few among many: the second link is one link among many
            assert len(firsts) >= 4 * len(asked)
