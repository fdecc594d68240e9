"""The memory encoder (models/memory.py) on the tiny encoder checkpoint, against transformers' Qwen3Model: causal
states are the checkpoint's own; left and right padding give the same states and padded positions are zero; a
bidirectional encoder lets an early token see a later one, a causal one does not; chunks are encoded each on its
own; what the encoder cannot read is refused with the fix."""

from __future__ import annotations

import pytest
import torch

from models.loading import load_encoder
from models.memory import MemoryEncoder
from tests.conftest import random_ids

VOCAB, POSITIONS = 496, 256  # the tiny encoder's


@pytest.fixture(scope="module")
def qwen3(checkpoint_root):
    return load_encoder(checkpoint_root / "tiny-qwen3-encoder").eval()


def encoder(qwen3, attention: str = "causal", grad_scale: float = 1.0) -> MemoryEncoder:
    return MemoryEncoder(qwen3, attention=attention, grad_scale=grad_scale).eval()


@torch.no_grad()
def test_causal_states_are_the_checkpoints_own(qwen3):
    ids = random_ids(2, 3, 8, vocab=VOCAB, seed=0)
    states, mask = encoder(qwen3)(ids)
    assert states.shape == (2, 24, qwen3.config.hidden_size) and mask.shape == (2, 24) and mask.all()
    reference = qwen3(input_ids=ids.reshape(6, 8)).last_hidden_state  # each chunk a sequence of its own
    torch.testing.assert_close(states.reshape(6, 8, -1), reference, rtol=1e-5, atol=1e-5)
    flat, flat_mask = encoder(qwen3)(ids[:, 0])  # (B, L): one chunk
    torch.testing.assert_close(flat, states[:, :8])
    assert torch.equal(flat_mask, mask[:, :8])


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
@torch.no_grad()
def test_left_and_right_padding_give_the_same_states_and_padding_is_zero(qwen3, attention):
    real = random_ids(5, vocab=VOCAB, seed=1)
    right = torch.cat([real, random_ids(3, vocab=VOCAB, seed=2)])[None, None]  # whatever sits in the padding
    left = torch.cat([torch.zeros(3, dtype=torch.long), real])[None, None]
    right_mask = torch.tensor([[[1] * 5 + [0] * 3]])
    left_mask = torch.tensor([[[0] * 3 + [1] * 5]])
    model = encoder(qwen3, attention)
    a, a_mask = model(right, right_mask)
    b, b_mask = model(left, left_mask)
    torch.testing.assert_close(a[0, :5], b[0, 3:], rtol=1e-5, atol=1e-5)
    assert a[0, 5:].eq(0).all() and b[0, :3].eq(0).all()
    assert a_mask.tolist() == right_mask[0].bool().tolist() and b_mask.tolist() == left_mask[0].bool().tolist()
    alone, _ = model(real[None, None])  # the unpadded chunk
    torch.testing.assert_close(a[0, :5], alone[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_bidirectional_encoder_lets_an_early_token_see_a_later_one(qwen3):
    ids = random_ids(1, 1, 8, vocab=VOCAB, seed=3)
    later = ids.clone()
    later[0, 0, -1] = (later[0, 0, -1] + 1) % VOCAB  # only the last token differs
    change = {}
    for attention in ("causal", "bidirectional"):
        model = encoder(qwen3, attention)
        change[attention] = (model(ids)[0][0, 0] - model(later)[0][0, 0]).abs().max().item()
    assert change["causal"] == 0 and change["bidirectional"] > 1e-4


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
@torch.no_grad()
def test_each_chunk_is_encoded_on_its_own(qwen3, attention):
    ids = random_ids(1, 2, 8, vocab=VOCAB, seed=4)
    other = ids.clone()
    other[0, 1] = random_ids(8, vocab=VOCAB, seed=5)  # another second chunk
    model = encoder(qwen3, attention)
    a, b = model(ids)[0], model(other)[0]
    assert torch.equal(a[0, :8], b[0, :8]) and not torch.equal(a[0, 8:], b[0, 8:])


def test_what_the_encoder_cannot_read_is_refused_with_the_fix(qwen3):
    model = encoder(qwen3)
    with pytest.raises(ValueError, match=rf"chunks of 300 tokens exceed the encoder's {POSITIONS} positions; split "
                                         r"the memory into chunks of at most 256 tokens, shaped "
                                         r"\[batch, chunks, chunk_len\]"):
        model(torch.zeros(1, 1, 300, dtype=torch.long))
    with pytest.raises(ValueError, match="holds token id 496, outside the encoder's vocabulary of 496 ids .* map or "
                                         "drop ids >= 496"):
        model(torch.full((1, 1, 4), VOCAB))
    with pytest.raises(ValueError, match="holds token id -1"):
        model(torch.full((1, 1, 4), -1))
    with pytest.raises(ValueError, match=r"must be \[batch, chunks, chunk_len\], got shape \(1, 1, 1, 4\)"):
        model(torch.zeros(1, 1, 1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"memory_attention_mask shape \(1, 1, 3\) differs"):
        model(torch.zeros(1, 1, 4, dtype=torch.long), torch.ones(1, 1, 3))
    with pytest.raises(ValueError, match="encoder_attention must be one of"):
        MemoryEncoder(qwen3, attention="sideways")


def test_grad_scale_scales_only_what_flows_into_the_encoder(qwen3):
    ids = random_ids(1, 2, 6, vocab=VOCAB, seed=6)

    def norm_grad(scale: float) -> torch.Tensor:
        qwen3.zero_grad()
        states, _ = encoder(qwen3, grad_scale=scale)(ids)
        states.pow(2).sum().backward()
        return qwen3.norm.weight.grad.clone()

    torch.testing.assert_close(norm_grad(4.0), 4 * norm_grad(1.0), rtol=1e-5, atol=1e-8)
    qwen3.zero_grad()
    with torch.no_grad():
        scaled, _ = encoder(qwen3, grad_scale=4.0)(ids)
    torch.testing.assert_close(scaled, encoder(qwen3)(ids)[0].detach())  # the forward is unchanged
