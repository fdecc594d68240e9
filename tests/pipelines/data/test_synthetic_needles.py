import numpy as np
import pytest

from pipelines.corpora.rows import IGNORE
from pipelines.data.synthetic_needles import BOS, EOS, EQ, PROMPT_LEN, SEP, NeedleSpec, make_batch, make_example


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
