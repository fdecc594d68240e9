"""models/reading.py: the reading options' one validation (every problem, named as its users name the option), the
whole-memory form, and the flat names of configs and format-1 exports."""

import pytest

from models.reading import MemoryReading


def test_every_problem_is_collected_and_named_by_the_given_prefix():
    bad = MemoryReading(top_k=-1, routing_loss=-1.0, summaries=0, chunk_weights="tokens", logn_scale=1)
    problems = bad.problems()
    assert len(problems) == 5
    assert [p.split(" ")[0] for p in problems] == ["memory_top_k", "memory_logn_scale", "memory_routing_loss",
                                                   "memory_summaries", "memory_chunk_weights"]
    assert all(p.startswith("model.memory_") for p in bad.problems(prefix="model.memory_"))
    with pytest.raises(ValueError, match="memory_top_k must be .*; memory_logn_scale must be"):  # one message
        bad.check()
    assert MemoryReading(top_k=2, logn_scale=64).problems() == []
    assert MemoryReading(top_k=2, logn_scale=64).problems("merged")[0].startswith("memory_top_k and memory_logn")
    assert MemoryReading().check("merged") == MemoryReading()


def test_reading_the_whole_memory_turns_routings_companions_off():
    routed = MemoryReading(top_k=2, chunk_weights="router", lexical_routing=3.0, lexical_reading=6.0, logn_scale=0,
                           lexical_gate=True, lexical_tokens=True)
    assert routed.with_top_k(4) == MemoryReading(top_k=4, chunk_weights="router", lexical_routing=3.0,
                                                 lexical_reading=6.0, lexical_gate=True, lexical_tokens=True)
    whole = routed.with_top_k(0)
    assert whole == MemoryReading() and not whole.routes and whole.problems() == []
    assert routed.problems() == [] and MemoryReading(logn_scale=64).with_top_k(0).logn_scale == 64
    assert (routed.lexical_weight(training=True), routed.lexical_weight(training=False)) == (3.0, 6.0)


def test_flat_names_read_back_with_absent_ones_at_their_defaults():
    assert MemoryReading.from_names({"memory_top_k": 2, "memory_summaries": 4, "fusion": "gca"}) == MemoryReading(
        top_k=2, summaries=4)
    assert MemoryReading.from_names({}) == MemoryReading()
