"""The training-time needle evaluation (pipelines/evaluate/in_training.py): one question a row, as jobs/evaluate.py
asks, and exact match over every answer token, for each variant of the mixture."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipelines.data.memory_modes import GCA, MemoryMode
from pipelines.data.synthetic_needles import EOS, NeedleSpec, needle_batch
from pipelines.evaluate.in_training import score_needles

SPEC = NeedleSpec()


class Reader(torch.nn.Module):
    """A stand-in model that predicts each row's next token (the teacher-forced truth), wrong at the token
    `wrong_from_end` tokens before the row's first EOS (0: the EOS itself, so the answer does not end there); it
    records the rows it was given."""

    def __init__(self, wrong_from_end: int | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.wrong_from_end, self.calls = wrong_from_end, []

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, input_ids, memory_input_ids=None, **_):
        self.calls.append(input_ids.clone())
        following = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], EOS)], dim=1)
        if self.wrong_from_end is not None:
            for row in following:
                eos = (row == EOS).nonzero()[0, 0]
                row[eos - self.wrong_from_end] = 0
        return SimpleNamespace(logits=torch.nn.functional.one_hot(following, 512).float())


def test_in_context_evaluation_asks_one_question_a_row():
    """Training rows ask questions_per_row questions after one copy of the memory; the evaluation's rows ask one,
    so no answer can follow from the ones before it, as in jobs/evaluate.py's prompts."""
    model = Reader()
    scores = score_needles(model, SPEC, 7, [0, 1, 2], mode=MemoryMode("in_context"))
    (rows,) = model.calls
    assert rows.shape[0] == 3 * SPEC.questions  # one row per question
    assert all(row[: SPEC.chunks * SPEC.chunk_len].ne(0).all() for row in rows)  # each starts with the whole memory
    assert scores.total == 3 * SPEC.questions and scores.accuracy == 1.0
    assert SPEC.questions_per_row > 1  # training still shares rows


@pytest.mark.parametrize("variant", ["single", "multi_value", "multi_query", "variable_tracking", "alias", "two_hop"])
@pytest.mark.parametrize("mode", [GCA, MemoryMode("in_context"), MemoryMode("rag"), MemoryMode("none")],
                         ids=lambda m: m.kind)
def test_exact_match_needs_every_answer_token(variant, mode):
    spec = NeedleSpec(variants=("single", "multi_value", "multi_query", "variable_tracking", "alias", "two_hop"))
    right = score_needles(Reader(), spec, 3, [0, 1], mode=mode, variant=variant, scale=2)
    assert right.accuracy == 1.0 and right.total > 0
    wrong_last = score_needles(Reader(wrong_from_end=1), spec, 3, [0, 1], mode=mode, variant=variant, scale=2)
    assert wrong_last.accuracy == 0.0  # the answer's last token (multi_value's and multi_query's 6th) counts
    runs_on = score_needles(Reader(wrong_from_end=0), spec, 3, [0, 1], mode=mode, variant=variant, scale=2)
    assert runs_on.accuracy == 0.0  # every reference, then no EOS: not a whole answer
    assert right.tokens == wrong_last.tokens
    per_question = {"multi_value": 6, "multi_query": 6, "two_hop": 4, "alias": 4}.get(variant, 3) + 1  # two_hop:
    # kb d d d; alias: key d d d
    assert right.tokens == right.total * per_question  # answer tokens and EOS, nothing else is a label


class OneOrder(torch.nn.Module):
    """A stand-in model that answers multi_value questions with the two values in the order of `batch`'s answers
    reversed (or `as_given`), whatever order its input holds: the truth elsewhere. It knows a row by its question
    and memory, not by its place in the batch, as a model does; it records the rows of every forward."""

    def __init__(self, batch, as_given: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.answers = {}  # (the row's question and memory, position before the token) -> the token predicted there
        self.forwards = []  # rows per forward
        memory = batch.get("memory_input_ids")
        memory = None if memory is None else memory.repeat_interleave(len(batch["input_ids"]) // len(memory), dim=0)
        for row, positions in zip(batch["answer_rows"].tolist(), batch["answer_positions"].tolist(), strict=True):
            tokens = batch["input_ids"][row, positions].tolist()
            values, eos = tokens[:-1], tokens[-1:]
            half = len(values) // 2
            order = tokens if as_given else values[half:] + values[:half] + eos
            known = self.known(batch["input_ids"][row, : positions[0]], None if memory is None else memory[row])
            self.answers |= {(known, p - 1): t for p, t in zip(positions, order, strict=True)}

    @staticmethod
    def known(question, memory) -> tuple:
        return tuple(question.tolist()), None if memory is None else tuple(memory.flatten().tolist())

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, input_ids, memory_input_ids=None, **_):
        self.forwards.append(len(input_ids))
        if memory_input_ids is not None:  # row i reads memory i // r, as the model does
            memory_input_ids = memory_input_ids.repeat_interleave(len(input_ids) // len(memory_input_ids), dim=0)
        following = torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], EOS)], dim=1)
        for (known, position), token in self.answers.items():
            for row in range(len(input_ids)):
                memory = None if memory_input_ids is None else memory_input_ids[row]
                if self.known(input_ids[row, : len(known[0])], memory) == known:
                    following[row, position] = token
        return SimpleNamespace(logits=torch.nn.functional.one_hot(following, 512).float())


@pytest.mark.parametrize("mode", [GCA, MemoryMode("in_context")], ids=lambda m: m.kind)
def test_multi_values_two_values_count_in_either_order_as_the_suite_counts_them(mode):
    """The target holds them in memory order; an answer with both values in the other order is exact, as
    jobs/evaluate.py's string_match_all scores it; both values but one wrong digit is not."""
    spec = NeedleSpec(variants=("multi_value",))
    batch = needle_batch(spec, 3, [0, 1], mode, variant="multi_value", questions_per_row=1)
    rows = len(batch["input_ids"])
    given = OneOrder(batch, as_given=True)
    assert score_needles(given, spec, 3, [0, 1], mode=mode, variant="multi_value").accuracy == 1
    assert given.forwards == [rows]  # nothing missed in memory order: no second forward
    reversed_model = OneOrder(batch)
    reversed_order = score_needles(reversed_model, spec, 3, [0, 1], mode=mode, variant="multi_value")
    assert reversed_order.accuracy == 1.0 and reversed_order.total == 2 * spec.questions
    assert reversed_model.forwards == [rows, rows]
    off = OneOrder(batch, as_given=True)
    first_question = next(iter(off.answers))
    off.answers[first_question] = 0  # a wrong digit in one question, in either order
    assert score_needles(off, spec, 3, [0, 1], mode=mode, variant="multi_value").accuracy == 1 - 1 / rows
    assert off.forwards == [rows, 1]  # only the missed question's row runs again
