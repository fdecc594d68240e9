"""The memory attention under each SDPA backend a GPU may pick equals the math backend: `attend_memory` (GCA blocks,
the cross fusion and the cross-attention decoder all read through it) with GQA, padded memory, a row without memory,
packed rows, the length-aware scale and chunk routing (both of its paths); gradients too; then whole models of each
fusion under the default dispatch against math only. And whether the padded, GQA read reaches a fused kernel at all.

Tolerances, as relative errors ||got - want|| / ||want|| against the same inputs through the math backend in
float32: 1e-5 in float32, 1e-2 in bfloat16 (one bf16 rounding of the output is ~4e-3; measured values are printed).
A whole model in bfloat16 against itself under math: 5e-2 (4 layers of bf16 roundings taken in another order, and
routing's top-k may flip a near tie; the CPU dry run measured 0.6-1.6e-2)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from models import MemoryReading, build_pair
from models.gca import ChunkRouting, MemoryKV, MemoryPadding, attend_memory, chunk_mask, kernel_heads
from tests.conftest import open_gates
from tests.gpu.conftest import relative_error

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
MODEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
B_MEM, R, T, H, H_KV, HD, CHUNKS, L = 2, 2, 8, 8, 2, 64, 8, 32  # r question rows per memory, M = CHUNKS * L
CASES = ("gqa", "padded", "no_memory_row", "packed", "logn", "routed_masked", "routed_gathered")
FUSED = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def memory_case(case: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(query (B, T, H, hd), MemoryKV) for one case, leaves requiring gradients."""
    g = torch.Generator().manual_seed(seed)
    m = CHUNKS * L
    rows = B_MEM if case == "packed" else B_MEM * R  # packed: one memory row per decoder row
    query = torch.randn(rows, T, H, HD, generator=g)
    key, value = torch.randn(2, B_MEM, H_KV, m, HD, generator=g).unbind(0)
    if case.startswith("routed"):  # every query carries +-3 along dimension 0, where the summaries below lie
        query[..., 0] += 3 * (2 * torch.randint(0, 2, (rows, T, 1), generator=g) - 1)
    mask = torch.ones(B_MEM, m, dtype=torch.bool)
    if case in ("padded", "no_memory_row", "packed", "routed_masked", "routed_gathered"):
        mask[0, m - L - 5:] = False  # the first memory's last chunk and a half are padding
        mask[1, 3 * L:4 * L] = False  # an all-padding chunk in the middle
    if case == "no_memory_row":
        mask[1] = False
    if case == "packed":  # two examples per row: tokens 0-3 read chunks 0-3, tokens 4-7 chunks 4-7
        query_segments = torch.arange(T).div(T // 2, rounding_mode="floor").expand(B_MEM, T)
        memory_segments = torch.arange(m).div(m // 2, rounding_mode="floor").expand(B_MEM, m)
        padding = MemoryPadding.packed(mask, memory_segments, query_segments)
    else:
        padding = MemoryPadding.from_mask(mask)
    leaves = [x.to(device, dtype).requires_grad_() for x in (query, key, value)]
    padding = MemoryPadding(*(None if x is None else x.to(device) for x in (padding.attn_mask, padding.has_memory)))
    memory = MemoryKV(leaves[1], leaves[2], padding, logn_base=64 if case == "logn" else 0)
    if case.startswith("routed"):
        # chunk scores far apart (chunk c's summary is (c - 4) along dimension 0), so
        # bf16 and fp32 pick the same top-k: random summaries flip near ties between dtypes (seen on an H200)
        summary = torch.zeros(B_MEM, H_KV, CHUNKS, HD)
        summary[..., 0] = torch.arange(CHUNKS) - CHUNKS // 2
        summary = summary.to(device, dtype)
        memory.routing = ChunkRouting(summary=summary, chunk_len=L, top_k=3, chunk_mask=chunk_mask(padding, L),
                                      path=case.removeprefix("routed_"))
    return leaves, memory


def attend(case: str, device, dtype, backends: list[SDPBackend] | None):
    """Output and gradients of query, key and value (a fixed random projection of the output as the loss)."""
    (query, key, value), memory = memory_case(case, device, dtype)
    with sdpa_kernel(backends) if backends else torch.enable_grad():
        out, _ = attend_memory(query, memory)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        (out * weights).sum().backward()
    return [out.detach(), query.grad, key.grad, value.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["flash", "efficient", "default"])
@pytest.mark.parametrize("case", CASES)
def test_memory_attention_under_each_backend_equals_math(case, backend, dtype, device):
    want = attend(case, device, torch.float32, [SDPBackend.MATH])
    try:
        got = attend(case, device, dtype, [FUSED[backend]] if backend in FUSED else None)
    except RuntimeError as error:
        if not any(refusal in str(error) for refusal in ("No available kernel", "No viable backend")):
            raise
        # which inputs a fused kernel refuses (a mask for flash, float32 for flash, ...) is torch's: the default
        # dispatch then falls back, and its case below must still match
        pytest.skip(f"{backend} takes no {case} input in {dtype} on {device.type}: {str(error).splitlines()[0]}")
    errors = [relative_error(g.float(), w) for g, w in zip(got, want, strict=True)]
    print(f"{case} {backend} {dtype}: output, dq, dk, dv relative errors {[f'{e:.1e}' for e in errors]}")
    assert max(errors) < TOLERANCE[dtype], errors


def test_the_padded_gqa_read_reaches_a_fused_kernel(device):
    """Training reads padded (and packed) memories with GQA: if no fused kernel takes that, every GCA layer falls
    back to the math kernel, which materialises (B, H, T, M) scores. torch's own eligibility checks, with reasons."""
    if device.type != "cuda":
        pytest.skip("fused-kernel eligibility is CUDA's")
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    (query, key, value), memory = memory_case("padded", device, torch.bfloat16)
    folded = query.reshape(B_MEM, R * T, H, HD).transpose(1, 2)  # as attend_memory folds it: (B_mem, H, r*T, hd)
    key, value, enable_gqa = kernel_heads(folded, key, value, memory.padding.attn_mask)  # as grouped_sdpa passes them
    params = SDPAParams(folded, key, value, memory.padding.attn_mask, 0.0, False, enable_gqa)
    usable = {"efficient": can_use_efficient_attention(params, True), "flash": can_use_flash_attention(params, True)}
    print(f"padded GQA memory read, bf16: {usable}")
    assert any(usable.values()), "the padded GQA memory read falls back to the math kernel (reasons warned above)"


def fusion_model(fusion: str, device, dtype, memory_top_k: int = 0):
    torch.manual_seed(0)
    model = build_pair("tiny", fusion=fusion, random_init=True, device=device, dtype=dtype, gca_layers="every_k:1",
                       reading=MemoryReading(top_k=memory_top_k))
    return open_gates(model) if fusion == "gca" else model


def fusion_inputs(device):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 500, (2, 12), generator=g)
    memory = torch.randint(3, 490, (2, 4, 16), generator=g)
    memory_mask = torch.ones(2, 4, 16, dtype=torch.long)
    memory_mask[0, 3, 5:] = 0
    memory_mask[1, 2] = 0
    return {"input_ids": ids.to(device), "memory_input_ids": memory.to(device),
            "memory_attention_mask": memory_mask.to(device)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fusion,top_k", [("gca", 0), ("gca", 2), ("cross", 0), ("cross", 2), ("merged", 0)])
def test_each_fusion_under_the_default_dispatch_equals_math(fusion, top_k, dtype, device):
    """A whole model's logits and loss (decoder self-attention included) as the GPU dispatches them, against the
    math kernel alone, in the same dtype."""
    model = fusion_model(fusion, device, dtype, top_k).eval()
    inputs = fusion_inputs(device)
    with torch.no_grad():
        got = model(**inputs, labels=inputs["input_ids"])
        with sdpa_kernel([SDPBackend.MATH]):
            want = model(**inputs, labels=inputs["input_ids"])
    error = relative_error(got.logits.float(), want.logits.float())
    print(f"{fusion} top_k {top_k} {dtype}: logits relative error {error:.1e}")
    assert error < MODEL_TOLERANCE[dtype]
    assert got.loss.dtype == torch.float32 and abs(got.loss.item() - want.loss.item()) < MODEL_TOLERANCE[dtype]
