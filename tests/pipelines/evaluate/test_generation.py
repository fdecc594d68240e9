"""Memory-conditioned generation (pipelines/evaluate/generation.py) on the tiny pair: with the gates closed every
memory gives the no-memory answer and the logits do not move at all; with them open, each memory's continuation is
the one that memory gets alone, and the reported change is the largest next-token logit difference."""

from __future__ import annotations

import torch

from pipelines.evaluate.generation import GenerationReport, generate_with_memories
from tests.conftest import open_gates, random_ids

PROMPT = random_ids(6, vocab=512, seed=0)
MEMORIES = random_ids(3, 2, 8, vocab=496, seed=1)  # three memories of two chunks


def test_closed_gates_answer_as_without_memory(tiny):
    report = generate_with_memories(tiny, PROMPT, MEMORIES, max_new_tokens=5)
    assert len(report.with_memory) == 3 and all(len(c) == 5 for c in report.with_memory)
    assert all(c == report.without_memory for c in report.with_memory)
    assert report.logit_change == 0.0  # closed gates add exactly nothing
    summary = report.summary()
    assert summary["matches_no_memory"] and not summary["memory_changes_output"]
    assert report.new_tokens == 4 * 5


def test_open_gates_answer_each_memory_as_alone(tiny):
    open_gates(tiny, 3.0)
    mask = torch.ones_like(MEMORIES)
    mask[2, 1, 4:] = 0  # the last memory's second chunk is half padding
    report = generate_with_memories(tiny, PROMPT, MEMORIES, mask, max_new_tokens=3)
    with torch.no_grad():
        for i, continuation in enumerate(report.with_memory):
            alone = tiny.generate(PROMPT[None], memory_input_ids=MEMORIES[i : i + 1],
                                  memory_attention_mask=mask[i : i + 1], max_new_tokens=3, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            assert continuation == alone[0, 6:].tolist()
        bare = tiny(input_ids=PROMPT.expand(3, -1)).logits[:, -1]
        read = tiny(input_ids=PROMPT.expand(3, -1), memory_input_ids=MEMORIES, memory_attention_mask=mask).logits[:, -1]
    assert report.logit_change == float((read - bare).abs().max()) > 0


def test_closed_gates_report_exactly_no_logit_change_on_two_threads(tiny):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        changes = [generate_with_memories(tiny, PROMPT, MEMORIES[:n], max_new_tokens=1).logit_change for n in (2, 3)]
    finally:
        torch.set_num_threads(threads)
    assert changes == [0.0, 0.0]


def test_summary_by_hand():
    report = GenerationReport(with_memory=[[1, 2], [1, 3]], without_memory=[1, 2], seconds=0.5, new_tokens=6,
                              logit_change=0.25)
    assert report.summary() == {"memory_changes_output": True, "matches_no_memory": False, "max_logit_change": 0.25,
                                "tokens_per_s": 12.0}
