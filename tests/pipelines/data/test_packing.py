"""Packed rows: several examples in one decoder row, each reading only its own memory chunks, give exactly what
each example gives alone."""

import pytest
import torch

from pipelines.data.packing import PackingSpec, PackStats, collate_packed, pack_examples
from pipelines.format.rows import IGNORE
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


def sdpa_masks(monkeypatch) -> list:
    """Records the attn_mask of every SDPA call (transformers' self-attention and the GCA blocks' reads)."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


@pytest.mark.parametrize("short_chunk", [False, True])
def test_rows_of_one_example_each_collate_plain_with_the_packed_loss_and_no_attention_mask(tiny, monkeypatch,
                                                                                          short_chunk):
    """A batch whose rows are each one example filling the row (a corpus of long examples, the GPU check's random
    rows) collates without segments; the loss equals the packed layout's, and no SDPA call gets a mask (the
    condition for the flash and cuDNN kernels) unless a chunk is short, where only the memory mask stays."""
    model = open_gates(tiny)
    spec = PackingSpec(max_tokens=12, max_chunks=3, chunk_len=CHUNK)
    rows = [{"input_ids": random_ids(12, vocab=DEC_VOCAB, seed=i).tolist(),
             "labels": [IGNORE] * 4 + random_ids(8, vocab=DEC_VOCAB, seed=5 + i).tolist(),
             "memory_input_ids": random_ids(3, CHUNK, vocab=ENC_VOCAB, seed=10 + i).tolist()} for i in range(2)]
    if short_chunk:
        rows[1]["memory_input_ids"][2] = rows[1]["memory_input_ids"][2][:3]
    stats = PackStats()
    plain = collate_packed(pack_examples(rows, spec, stats), spec, stats)
    assert stats.real_tokens == 24 and stats.padded_tokens == 0
    assert sorted(plain) == sorted(["input_ids", "labels", "memory_input_ids"]
                                   + (["memory_attention_mask"] if short_chunk else []))
    mask = plain.get("memory_attention_mask", torch.ones_like(plain["memory_input_ids"]))
    packed = dict(plain, position_ids=torch.arange(12).expand(2, 12), segment_ids=torch.zeros(2, 12, dtype=torch.long),
                  memory_attention_mask=mask, memory_segment_ids=torch.zeros(2, 3, dtype=torch.long))
    seen = sdpa_masks(monkeypatch)
    with torch.no_grad():
        expected = model(**packed).loss
        assert any(m is not None for m in seen)  # the packed layout attends through masks
        seen.clear()
        loss = model(**plain).loss
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    decoder_layers = model.decoder.config.num_hidden_layers
    unmasked = sum(m is None for m in seen)
    if short_chunk:  # the chunk's padding: the encoder's and the GCA reads' masks; the decoder's attention needs none
        assert unmasked >= decoder_layers and unmasked < len(seen)
    else:
        assert unmasked == len(seen) >= decoder_layers + len(model.gca_blocks())


def test_a_batch_with_a_packed_or_padded_row_keeps_the_packed_layout():
    spec = PackingSpec(max_tokens=12, max_chunks=3, chunk_len=CHUNK)
    full = {"input_ids": [5] * 12, "labels": [5] * 12, "memory_input_ids": [[6] * CHUNK]}
    short = {"input_ids": [5] * 6, "labels": [5] * 6, "memory_input_ids": [[6] * CHUNK]}
    for rows in ([full, short], [full, short, short]):  # a padded row; then two examples sharing a row
        batch = collate_packed(pack_examples(rows, spec), spec)
        assert {"segment_ids", "position_ids", "memory_segment_ids"} <= set(batch)
