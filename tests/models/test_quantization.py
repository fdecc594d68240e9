"""QLoRA on the tiny pair through bitsandbytes' CPU backend: which weights load in 4 (or 8) bits, what trains, that
a step moves only that, and the 4-bit forward against an fp32 forward over the same (dequantized) weights."""

import bitsandbytes as bnb
import pytest
import torch
from bitsandbytes.functional import dequantize_4bit
from torch import nn

from models import AwarenessModel, LoraPlan, LoraSettings, MemoryReading, apply_lora, build_pair, set_trainable
from models.quantization import WEIGHT_BITS, quantized_bytes, quantized_linears
from models.trainable import is_added_parameter
from tests.conftest import open_gates, random_ids


def nf4_pair(checkpoint_root, **kwargs) -> AwarenessModel:
    torch.manual_seed(0)
    return build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers="upper_half", quantize="nf4", **kwargs)


def qlora(model: AwarenessModel) -> AwarenessModel:
    """The stage jobs' QLoRA setting: decoder LoRA, the GCA blocks (routers too) trained in full, the rest frozen."""
    apply_lora(model, LoraPlan(decoder=LoraSettings(rank=4)))
    set_trainable(model, decoder="lora", encoder="frozen", gca="full")
    return open_gates(model)


def logits(model: AwarenessModel, seed: int = 0) -> torch.Tensor:
    ids = random_ids(2, 9, vocab=512, seed=seed)
    memory = random_ids(2, 3, 8, vocab=496, seed=seed + 1)
    with torch.no_grad():
        return model(input_ids=ids, memory_input_ids=memory).logits


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: packed 4-bit weights read as floats hold NaN patterns, which torch.equal calls unequal."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_every_base_linear_but_the_head_loads_as_4bit_and_the_plan_names_the_same(checkpoint_root):
    model = nf4_pair(checkpoint_root)
    meta = build_pair("tiny", device="meta", gca_layers="upper_half")
    for loaded, planned in ((model.decoder, meta.decoder), (model.memory_encoder.encoder, meta.memory_encoder.encoder)):
        four_bit = sorted(n for n, m in loaded.named_modules() if isinstance(m, bnb.nn.Linear4bit))
        assert four_bit and four_bit == sorted(n for n in quantized_linears(planned) if ".cross_attention." not in n)
    decoder_linears = [n for n, m in model.decoder.named_modules() if isinstance(m, nn.Linear)]
    assert {n for n in decoder_linears if not isinstance(model.decoder.get_submodule(n), bnb.nn.Linear4bit)} == {
        n for n in decoder_linears if ".cross_attention." in n} | {"lm_head"}  # added blocks and the (tied) head
    q_proj = model.decoder.model.layers[0].self_attn.q_proj
    # NF4 with double quantization, packed into the compute dtype's container (what ZeRO-3 partitions)
    assert q_proj.weight.quant_state.quant_type == "nf4" and q_proj.weight.quant_state.nested
    weights = q_proj.in_features * q_proj.out_features
    assert q_proj.weight.dtype == torch.float32 and q_proj.weight.numel() * 4 * 2 == weights  # 8 NF4 codes a float
    assert quantized_bytes(q_proj, "nf4") == pytest.approx(weights * 4.127 / 8, rel=1e-3)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if is_added_parameter(n))


def test_trainable_parameters_are_exactly_lora_gca_routers_and_norms(checkpoint_root):
    quantized = qlora(nf4_pair(checkpoint_root, reading=MemoryReading(top_k=2)))
    torch.manual_seed(0)
    full = qlora(build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers="upper_half",
                            reading=MemoryReading(top_k=2)))
    trainable = {n for n, p in quantized.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in full.named_parameters() if p.requires_grad}  # the same set as in 32 bits
    assert all("lora_" in n or ".cross_attention." in n or n.startswith("memory_projection.") for n in trainable)
    for part in (".router.", "norm.weight", "gate", "lora_A", "lora_B", "memory_projection."):
        assert any(part in n for n in trainable), part
    four_bit = [n for n, p in quantized.named_parameters() if isinstance(p, bnb.nn.Params4bit)]
    assert four_bit and not trainable & set(four_bit)


def test_a_training_step_changes_only_what_trains(checkpoint_root):
    model = qlora(nf4_pair(checkpoint_root)).train()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    ids = random_ids(2, 9, vocab=512, seed=3)
    for _ in range(2):  # lora_B starts at 0, so lora_A gets its first gradient on the second step
        model(input_ids=ids, labels=ids, memory_input_ids=random_ids(2, 3, 8, vocab=496, seed=4)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = model.state_dict()
    changed = {n for n in before if not same_bytes(before[n], after[n])}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert changed == trainable, sorted(changed ^ trainable)[:5]


def test_4bit_forward_is_the_fp32_forward_over_its_dequantized_weights(checkpoint_root):
    quantized = open_gates(nf4_pair(checkpoint_root)).eval()
    # bitsandbytes' AVX512-BF16 CPU path would compute in bf16 in eval mode only: off for an fp32 compute dtype
    assert not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in quantized.modules())
    torch.manual_seed(0)
    reference = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers="upper_half")).eval()
    original = logits(reference)
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, bnb.nn.Linear4bit):
                weight = dequantize_4bit(module.weight.data, module.weight.quant_state)
                reference.get_submodule(name).weight.copy_(weight)
    assert all(torch.equal(p, reference.state_dict()[n]) for n, p in quantized.state_dict().items()
               if is_added_parameter(n))  # the same seed gave the same GCA blocks
    torch.testing.assert_close(logits(quantized), logits(reference), rtol=1e-4, atol=1e-4)
    # and near the unquantized pair: NF4's error on N(0, 0.02) weights, through 4 random layers
    cosine = nn.functional.cosine_similarity(logits(quantized).flatten(), original.flatten(), dim=0)
    assert cosine > 0.95, cosine


def test_int8_loads_llm_int8_linears_and_runs(checkpoint_root):
    torch.manual_seed(0)
    model = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers="upper_half", quantize="int8"))
    torch.manual_seed(0)
    reference = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers="upper_half"))
    assert isinstance(model.decoder.model.layers[0].mlp.down_proj, bnb.nn.Linear8bitLt)
    assert model.decoder.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    cosine = nn.functional.cosine_similarity(logits(model.eval()).flatten(), logits(reference.eval()).flatten(), dim=0)
    assert cosine > 0.99, cosine  # 8 bits per weight with a scale per row: closer than NF4
    assert WEIGHT_BITS["int8"] == 8


def test_meta_and_random_init_builds_refuse_quantize():
    with pytest.raises(ValueError, match="quantize apply to pairs loaded from checkpoints"):
        build_pair("tiny", device="meta", quantize="nf4")


def test_an_export_whose_decoder_trained_in_full_refuses_a_quantized_base(checkpoint_root, tmp_path):
    """Its decoder weights are the export's own: a 4-bit base could not hold them, so the load says so instead of
    failing on a shape (what the Serve app and the pyfunc's `quantize` get)."""
    model = build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers="upper_half")
    set_trainable(model, decoder="full", encoder="frozen", gca="full")
    export = model.save_pretrained(tmp_path / "export")
    with pytest.raises(ValueError, match="trained its decoder in full.*load it with quantize none"):
        AwarenessModel.from_pretrained(export, quantize="nf4")
    AwarenessModel.from_pretrained(export)  # the stored base still loads it
