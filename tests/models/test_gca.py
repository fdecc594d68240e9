"""GatedCrossAttention against a plain softmax reference, and its invariants."""

import math

import pytest
import torch

from models.gca import GatedCrossAttention, gca_parameter_count

H, NH, NKV, HD = 32, 4, 2, 8


def make_block(**kwargs) -> GatedCrossAttention:
    torch.manual_seed(0)
    block = GatedCrossAttention(hidden_size=H, num_heads=NH, num_kv_heads=NKV, head_dim=HD, **kwargs)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return block


def rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference(block: GatedCrossAttention, x, memory, mask):
    """Materialised softmax attention, written independently of the module's SDPA/GQA/fold path."""
    b, t, _ = x.shape
    q = rms(block.q_proj(rms(x, block.input_norm.weight)).view(b, t, NH, HD), block.q_norm.weight).transpose(1, 2)
    k = rms(block.k_proj(memory).view(b, -1, NKV, HD), block.k_norm.weight).transpose(1, 2)
    v = block.v_proj(memory).view(b, -1, NKV, HD).transpose(1, 2)
    k, v = k.repeat_interleave(NH // NKV, dim=1), v.repeat_interleave(NH // NKV, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(HD)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, NH * HD)
    return x + torch.tanh(block.gate) * block.o_proj(out)


def inputs(b=2, t=5, m=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, memory = torch.randn(b, t, H, generator=g), torch.randn(b, m, H, generator=g)
    mask = torch.ones(b, m, dtype=torch.bool)
    mask[1, 4:] = False
    return x, memory, mask


def test_matches_softmax_reference():
    block = make_block()
    x, memory, mask = inputs()
    out = block(x, block.project_memory(memory, mask))
    torch.testing.assert_close(out, reference(block, x, memory, mask), rtol=1e-5, atol=1e-5)


def test_gate_at_zero_is_identity():
    block = make_block()
    with torch.no_grad():
        block.gate.zero_()
    x, memory, mask = inputs()
    assert torch.equal(block(x, block.project_memory(memory, mask)), x)


def test_padded_memory_positions_have_no_effect():
    block = make_block()
    x, memory, mask = inputs()
    changed = memory.clone()
    changed[1, 4:] = 1e4 * torch.randn(3, H)
    out = block(x, block.project_memory(memory, mask))
    torch.testing.assert_close(block(x, block.project_memory(changed, mask)), out, rtol=0, atol=0)
    changed[1, 0] += 1.0  # a real position does matter
    assert not torch.allclose(block(x, block.project_memory(changed, mask))[1], out[1])


def test_rows_sharing_a_memory_fold_into_the_query_length():
    """Beams / several questions per memory: row i reads memory i // r, exactly as if the memory were repeated."""
    block = make_block()
    x, memory, mask = inputs(b=6)
    small = block.project_memory(memory[:2], mask[:2])
    repeated = block.project_memory(memory[:2].repeat_interleave(3, 0), mask[:2].repeat_interleave(3, 0))
    torch.testing.assert_close(block(x, small), block(x, repeated), rtol=1e-5, atol=1e-6)


def test_all_padding_memory_reads_nothing():
    block = make_block()
    x, memory, mask = inputs()
    mask[0] = False
    out = block(x, block.project_memory(memory, mask))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], x[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], reference(block, x, memory, mask)[1], rtol=1e-5, atol=1e-5)


def test_optional_gated_mlp_starts_closed_and_counts():
    block = make_block(mlp_intermediate_size=24)
    with torch.no_grad():
        block.gate.zero_(), block.mlp_gate.zero_()
    x, memory, mask = inputs()
    assert torch.equal(block(x, block.project_memory(memory, mask)), x)
    assert sum(p.numel() for p in block.parameters()) == gca_parameter_count(
        hidden_size=H, num_heads=NH, num_kv_heads=NKV, head_dim=HD, num_gca_layers=1, encoder_hidden_size=H,
        mlp_intermediate_size=24,
    )


@pytest.mark.parametrize("bias", [False, True])
def test_parameter_count_formula(bias):
    block = make_block(attention_bias=bias)
    assert sum(p.numel() for p in block.parameters()) == gca_parameter_count(
        hidden_size=H, num_heads=NH, num_kv_heads=NKV, head_dim=HD, num_gca_layers=1, encoder_hidden_size=H,
        attention_bias=bias,
    )


def test_gradient_reaches_gate_first():
    """At gate 0 only the gate gets a gradient; the block's projections start learning once it opens."""
    block = make_block()
    with torch.no_grad():
        block.gate.zero_()
    x, memory, mask = inputs()
    block(x, block.project_memory(memory, mask)).pow(2).sum().backward()
    assert block.gate.grad.abs().item() > 0
    assert block.q_proj.weight.grad.abs().max().item() == 0


def reference_attention(block: GatedCrossAttention, x, memory, mask):
    """The written-out softmax over the memory tokens, (B, H, T, M)."""
    b, t, _ = x.shape
    q = rms(block.q_proj(rms(x, block.input_norm.weight)).view(b, t, NH, HD), block.q_norm.weight).transpose(1, 2)
    k = rms(block.k_proj(memory).view(b, -1, NKV, HD), block.k_norm.weight).transpose(1, 2).repeat_interleave(2, 1)
    return (q @ k.transpose(-1, -2) / math.sqrt(HD)).masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)


def test_memory_attention_is_the_reference_distribution():
    """What probes read (GatedCrossAttention.memory_attention): the attention forward uses, computed again."""
    block = make_block()
    x, memory, mask = inputs()
    probs = block.memory_attention(x, block.project_memory(memory, mask))  # (B, H, T, M)
    torch.testing.assert_close(probs, reference_attention(block, x, memory, mask), rtol=1e-5, atol=1e-6)
    assert not block._forward_pre_hooks and not block._forward_hooks  # a method, not a state the block keeps
