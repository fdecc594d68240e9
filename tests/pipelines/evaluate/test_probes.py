"""pipelines/evaluate/probes.py: the memory-attention probe's hooks record what the GCA blocks attend, against the
written-out softmax, and leave nothing behind."""

from __future__ import annotations

import math

import pytest
import torch

from models import build_pair
from pipelines.evaluate.probes import attention_entropy, mean_entropy, memory_attention, memory_attention_probe
from tests.conftest import open_gates, random_ids
from tests.models.test_fusion import DEC_VOCAB, memory_batch, pair
from tests.models.test_gca import inputs, make_block, reference_attention


def test_the_entropy_probe_matches_the_reference_distribution():
    block = make_block()
    x, memory, mask = inputs()
    with memory_attention_probe({0: block}) as seen:
        block(x, block.project_memory(memory, mask))
    p = reference_attention(block, x, memory, mask)
    expected = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
    torch.testing.assert_close(mean_entropy(seen[0]), expected, rtol=1e-5, atol=1e-6)
    assert 0 < mean_entropy(seen[0]) < math.log(7)
    assert not block._forward_pre_hooks  # the hooks are gone with the probe


def test_a_model_probe_reads_every_gca_layer_at_the_last_position_and_removes_its_hooks(checkpoint_root):
    model = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root)).eval()
    ids = random_ids(2, 5, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    mask[1, 2, 4:] = 0  # padding, which no probe reads
    inputs = dict(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask)
    maps = memory_attention(model, **inputs)
    assert len(maps) == len(model.gca_layers)
    with memory_attention_probe(model.gca_blocks()) as seen, torch.no_grad():
        model(**inputs)
    for layer, read in zip(sorted(seen), maps, strict=True):
        torch.testing.assert_close(read, seen[layer][:, :, -1])  # (B, H, M): the last position's attention
        torch.testing.assert_close(read.sum(-1), torch.ones(read.shape[:2]))
        assert float(read[1, :, 2 * 8 + 4:3 * 8].abs().max()) == 0.0
    entropies = attention_entropy(model, **inputs)
    assert entropies == pytest.approx({i: float(mean_entropy(p)) for i, p in seen.items()})
    assert not any(block._forward_pre_hooks for block in model.gca_blocks().values())


def test_a_model_without_gca_blocks_is_refused(checkpoint_root):
    with pytest.raises(ValueError, match="probes GCA blocks"):
        memory_attention(pair(checkpoint_root, "merged"), input_ids=random_ids(1, 4, vocab=DEC_VOCAB, seed=0))
