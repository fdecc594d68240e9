"""Packed rows: several examples in one decoder row, each reading only its own memory chunks, give exactly what
each example gives alone."""

import pytest
import torch

from tests.conftest import open_gates, random_ids

DEC_VOCAB, ENC_VOCAB, CHUNK = 512, 496, 8


def test_packed_row_equals_each_example_alone(tiny):
    model = open_gates(tiny)
    lengths, chunks = (5, 7, 4), (2, 1, 3)  # tokens and memory chunks per example
    examples = [
        (random_ids(1, n, vocab=DEC_VOCAB, seed=i), random_ids(1, c, CHUNK, vocab=ENC_VOCAB, seed=10 + i))
        for i, (n, c) in enumerate(zip(lengths, chunks))
    ]
    tail = 3  # padding after the last example
    ids = torch.cat([e[0] for e in examples] + [torch.zeros(1, tail, dtype=torch.long)], dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(tail)])[None]
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((tail,), -1)])[None]
    memory = torch.cat([e[1] for e in examples] + [torch.zeros(1, 1, CHUNK, dtype=torch.long)], dim=1)
    memory_mask = torch.ones_like(memory)
    memory_mask[:, -1] = 0  # one padding chunk
    memory_segments = torch.cat([torch.full((c,), i) for i, c in enumerate(chunks)] + [torch.tensor([-1])])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, segment_ids=segments, memory_input_ids=memory,
                       memory_attention_mask=memory_mask, memory_segment_ids=memory_segments).logits
        start = 0
        for (example_ids, example_memory), n in zip(examples, lengths):
            alone = model(input_ids=example_ids, memory_input_ids=example_memory).logits
            torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-4, atol=1e-5)
            start += n
        # and the memory matters: another example's chunks would change the answer
        swapped = model(input_ids=examples[0][0], memory_input_ids=examples[2][1]).logits
    assert not torch.allclose(packed[:, : lengths[0]], swapped, atol=1e-4)


def test_packed_rows_need_positions_and_both_segment_kinds(tiny):
    ids = random_ids(1, 6, vocab=DEC_VOCAB, seed=0)
    memory = random_ids(1, 2, CHUNK, vocab=ENC_VOCAB, seed=1)
    segments = torch.tensor([[0, 0, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="position_ids"):
        tiny(input_ids=ids, memory_input_ids=memory, segment_ids=segments, memory_segment_ids=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="both segment_ids"):
        tiny(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), memory_input_ids=memory,
             segment_ids=segments)
