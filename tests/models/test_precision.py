"""The dtype choices a bf16 run rests on (bf16 on the CPU; tests/gpu/ repeats the kernels' share on CUDA):

* parameters, gates included, are bf16 in the module (DeepSpeed's bf16 keeps the fp32 masters in its optimizer);
  a closed gate still gives exactly the pretrained decoder, bit for bit, in bf16;
* RMSNorm (every GCA block's input_norm, q_norm, k_norm) computes in fp32 and rounds once (transformers' Qwen3RMSNorm);
* the softmax over the memory is fp32 inside SDPA: a bf16 read of 4,096 memory tokens equals the fp32 attention
  of the same bf16 inputs to one bf16 rounding of the output;
* the memory store keeps the encoder's dtype and the model casts what it reads to its own (prepare_memory);
* the language-model loss, the routing loss and evaluation's logits are fp32;
* RoPE's frequencies stay fp32 (transformers' loading and DeepSpeed's bf16 cast both cast parameters only);
* an export written from a bf16 model reloads in bf16 and in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import AwarenessModel, MemoryReading, build_pair
from models.gca import MemoryKV, MemoryPadding, attend_memory
from tests.conftest import open_gates, random_ids

BF16_ROUNDING = 2**-8  # bf16's relative spacing: 8 bits of mantissa


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    mask = torch.ones(2, 3, 8, dtype=torch.long)
    mask[1, 2, 3:] = 0
    return {"input_ids": random_ids(2, 10, vocab=512, seed=seed), "memory_input_ids": random_ids(2, 3, 8, vocab=496,
            seed=seed + 1), "memory_attention_mask": mask}


def test_a_bf16_model_is_bf16_throughout_and_a_closed_gate_is_the_decoder_bit_for_bit(tiny):
    model = tiny.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    inputs = batch()
    with torch.no_grad():
        closed = model(**inputs).logits
        alone = model.decoder(input_ids=inputs["input_ids"]).logits
    assert torch.equal(closed, alone)


def test_rms_norm_computes_in_fp32_and_rounds_once(tiny):
    norm = next(iter(tiny.gca_blocks().values())).input_norm
    x = torch.randn(4, 64).to(torch.bfloat16) * 30
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)) * norm.weight
    got = norm.to(torch.bfloat16)(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want.to(torch.bfloat16))  # one rounding at the end, no bf16 intermediate


def test_the_softmax_over_a_long_memory_is_fp32():
    """4,096 memory tokens: bf16 probabilities (spacing 2^-8 near 1/4096's neighbours) would lose most of the mass's
    resolution; the bf16 read is within one output rounding of fp32 attention over the same bf16 inputs."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 16, 4, 64, generator=g).to(torch.bfloat16)  # (B, T, H, hd)
    key, value = torch.randn(2, 1, 2, 4096, 64, generator=g).to(torch.bfloat16).unbind(0)  # (B, H_kv, M, hd) each
    mask = torch.ones(1, 4096, dtype=torch.bool)
    mask[0, 3000:] = False
    got, _ = attend_memory(query, MemoryKV(key, value, MemoryPadding.from_mask(mask)))
    want, _ = attend_memory(query.float(), MemoryKV(key.float(), value.float(), MemoryPadding.from_mask(mask)))
    assert got.dtype == torch.bfloat16
    assert relative_error(got, want) < 2 * BF16_ROUNDING


def test_the_memory_store_keeps_the_encoders_dtype_and_the_model_casts_it(tiny):
    inputs = batch()
    open_gates(tiny)
    with torch.no_grad():
        states, mask = tiny.encode_memory(inputs["memory_input_ids"], inputs["memory_attention_mask"])  # fp32
        bf16 = tiny.to(torch.bfloat16)
        read = bf16(input_ids=inputs["input_ids"], memory_states=states, memory_states_mask=mask).logits
        own = bf16(input_ids=inputs["input_ids"], memory_states=states.to(torch.bfloat16),
                   memory_states_mask=mask).logits
    assert states.dtype == torch.float32 and torch.equal(read, own)


def test_losses_are_fp32_in_a_bf16_model(checkpoint_root):
    model = build_pair("tiny", checkpoint_root=checkpoint_root, reading=MemoryReading(top_k=2),
                       dtype=torch.bfloat16).train()
    open_gates(model)
    inputs = batch()
    out = model(**inputs, labels=inputs["input_ids"])
    assert out.logits is None  # training keeps no full logits (models/loss.py): the same weights' in eval mode
    assert out.loss.dtype == torch.float32 and out.routing_loss.dtype == torch.float32
    with torch.no_grad():
        logits = model.eval()(**inputs).logits
    assert logits.dtype == torch.bfloat16
    want = F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), inputs["input_ids"][:, 1:].flatten())
    assert torch.allclose(out.loss - model.reading.routing_loss * out.routing_loss, want, atol=1e-5)


def test_a_bf16_export_reloads_in_bf16_and_fp32(checkpoint_root, tmp_path):
    """Built in bf16 as a run loads it (transformers' loading, as DeepSpeed's bf16 cast: parameters only), so RoPE's
    frequencies stay fp32; a blanket `module.to(torch.bfloat16)` would round them too (a 2^-9 error in the angle,
    several radians at position 4,096)."""
    bf16 = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root, dtype=torch.bfloat16).eval())
    assert bf16.decoder.model.rotary_emb.inv_freq.dtype == torch.float32
    bf16.save_pretrained(tmp_path / "export")
    inputs = batch()
    with torch.no_grad():
        want = bf16(**inputs).logits
        for dtype in (torch.bfloat16, torch.float32):
            model = AwarenessModel.from_pretrained(tmp_path / "export", dtype=dtype).eval()
            assert {p.dtype for p in model.parameters()} == {dtype}
            got = model(**inputs).logits
            # bf16: the same model; fp32: the bf16 weights computed in fp32, within bf16's rounding of the logits
            assert relative_error(got, want) < (1e-6 if dtype == torch.bfloat16 else 4 * BF16_ROUNDING), dtype
