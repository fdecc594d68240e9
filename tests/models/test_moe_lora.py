"""LoRA on Qwen3-MoE's fused experts (the decoder target `experts`, PEFT target_parameters)."""

import json

import pytest
import torch
import torch.nn.functional as F
from peft.tuners.lora import ParamWrapper
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import Qwen3MoeForCausalLM

from models import AwarenessModel, LoraPlan, LoraSettings, apply_lora, set_trainable
from models.awareness import WEIGHTS_NAME
from models.trainable import ATTENTION, EXPERTS
from tests.conftest import open_gates, random_ids

RANK, ALPHA = 4, 6.0  # scaling 1.5, so a wrong alpha or rank pattern shows
E, H, INTER = 4, 64, 32  # tiny-moe: experts, hidden width, expert intermediate width


def with_expert_lora(model: AwarenessModel, targets=(EXPERTS,)) -> AwarenessModel:
    apply_lora(model, LoraPlan(decoder=LoraSettings(rank=RANK, alpha=ALPHA, targets=targets),
                               gca=LoraSettings(rank=2, targets=ATTENTION)))
    return model


def randomise_adapters(model: AwarenessModel) -> None:
    """As after training: every LoRA factor non-zero (a fresh B is zero)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.1)


def logits(model, **kwargs):
    ids = random_ids(2, 9, vocab=512, seed=0)
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


def expert_wrappers(model: AwarenessModel, layer: int) -> dict[str, ParamWrapper]:
    experts = model.decoder.model.layers[layer]
    return {m.parameter_name: m for m in experts.modules() if isinstance(m, ParamWrapper)}


def test_expert_adapters_have_the_decoder_rank_and_peft_shapes(tiny_moe):
    with_expert_lora(tiny_moe)
    for layer in range(4):
        wrappers = expert_wrappers(tiny_moe, layer)
        assert set(wrappers) == {"gate_up_proj", "down_proj"}
        for name, (inputs, outputs) in {"gate_up_proj": (H, 2 * INTER), "down_proj": (INTER, H)}.items():
            w = wrappers[name]
            assert w.r["default"] == RANK and w.scaling["default"] == ALPHA / RANK
            # one rank-r pair per expert, stacked: E * r * (in + out) parameters per fused weight
            assert w.lora_A["default"].weight.shape == (E * RANK, inputs)
            assert w.lora_B["default"].weight.shape == (outputs, E * RANK)
    assert not any("lora_" in n for n, _ in tiny_moe.named_parameters() if ".mlp.gate." in n)  # the router


def test_expert_lora_starts_as_the_base_model_then_equals_a_hand_computed_moe_block(tiny_moe, checkpoint_root):
    open_gates(tiny_moe)
    mem = random_ids(2, 2, 8, vocab=496, seed=1)
    before = logits(tiny_moe, memory_input_ids=mem)
    with_expert_lora(tiny_moe)
    torch.testing.assert_close(logits(tiny_moe, memory_input_ids=mem), before, rtol=0, atol=0)  # B starts at zero
    randomise_adapters(tiny_moe)
    assert (logits(tiny_moe, memory_input_ids=mem) - before).abs().max() > 1e-2

    # Layer 3 (a GCA layer: its decoder layer is wrapped) against a plain MoE block built from the checkpoint's
    # per-expert weights plus B_e @ A_e * alpha / r, with PEFT's layout of the stacked factors: A's rows are
    # expert-major (E, r), B's columns rank-major (r, E).
    layer = 3
    block = tiny_moe.decoder.model.layers[layer].decoder_layer.mlp
    wrappers = expert_wrappers(tiny_moe, layer)
    prefix = f"model.layers.{layer}.mlp"
    with safe_open(str(checkpoint_root / "tiny-qwen3-moe" / "model.safetensors"), "pt") as f:
        base = {k.removeprefix(prefix + "."): f.get_tensor(k) for k in f.keys() if k.startswith(prefix + ".")}

    def delta(name: str, e: int) -> torch.Tensor:
        a = wrappers[name].lora_A["default"].weight.detach().view(E, RANK, -1)[e]
        b = wrappers[name].lora_B["default"].weight.detach().view(-1, RANK, E)[:, :, e]
        return b @ a * ALPHA / RANK

    x = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    probs = F.softmax(x @ base["gate.weight"].T, dim=-1)
    top, chosen = probs.topk(2, dim=-1)
    top = top / top.sum(-1, keepdim=True)  # norm_topk_prob
    expected = torch.zeros_like(x)
    for t in range(len(x)):
        for k in range(2):
            e = int(chosen[t, k])
            gate_up = torch.cat([base[f"experts.{e}.gate_proj.weight"], base[f"experts.{e}.up_proj.weight"]])
            gate_up = gate_up + delta("gate_up_proj", e)
            down = base[f"experts.{e}.down_proj.weight"] + delta("down_proj", e)
            g, u = (gate_up @ x[t]).chunk(2)
            expected[t] += top[t, k] * (down @ (F.silu(g) * u))
    # transformers picks an experts kernel (grouped_mm by default); PEFT swaps the weight itself, so all see it
    for implementation in ("grouped_mm", "batched_mm", "eager"):
        tiny_moe.decoder.set_experts_implementation(implementation)
        with torch.no_grad():
            torch.testing.assert_close(block(x[None])[0], expected, rtol=1e-5, atol=1e-6)


def test_only_adapters_train_and_get_gradients_with_and_without_checkpointing(tiny_moe):
    with_expert_lora(tiny_moe)
    randomise_adapters(tiny_moe)  # with B = 0 the gradient of A would be zero
    counts = set_trainable(tiny_moe, decoder="lora", encoder="frozen", gca="lora")
    trainable = {n for n, p in tiny_moe.named_parameters() if p.requires_grad}
    assert all("lora_" in n or n.endswith(".gate") for n in trainable)
    expert_lora = {n for n in trainable if ".mlp.experts." in n}
    assert len(expert_lora) == 4 * 2 * 2  # layers x (gate_up, down) x (A, B)
    assert counts["decoder"] == 4 * (E * RANK * (H + 2 * INTER) + E * RANK * (INTER + H))
    assert not any(p.requires_grad for n, p in tiny_moe.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))

    ids, mem = random_ids(2, 9, vocab=512, seed=0), random_ids(2, 2, 8, vocab=496, seed=1)
    tiny_moe.train()
    calls = []
    for wrapper in (m for m in tiny_moe.modules() if isinstance(m, ParamWrapper)):
        wrapper.register_forward_pre_hook(lambda *_: calls.append(1))

    def gradients():
        tiny_moe.zero_grad(set_to_none=True)
        loss = tiny_moe(input_ids=ids, labels=ids, memory_input_ids=mem).loss
        calls.clear()
        loss.backward()
        return {n: p.grad.clone() for n, p in tiny_moe.named_parameters() if p.grad is not None}

    plain = gradients()
    assert plain.keys() == trainable and not calls
    assert all(plain[n].abs().sum() > 0 for n in expert_lora)
    tiny_moe.gradient_checkpointing_enable()
    checkpointed = gradients()
    assert len(calls) == 4 * 2  # backward recomputed every layer's expert wrappers
    assert checkpointed.keys() == plain.keys()
    for name in expert_lora:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)


def test_round_trip_and_merged_export_keep_the_expert_adapters(tiny_moe, checkpoint_root, tmp_path):
    with_expert_lora(tiny_moe, targets=ATTENTION + (EXPERTS,))
    set_trainable(tiny_moe, decoder="lora", gca="lora")
    open_gates(tiny_moe)
    randomise_adapters(tiny_moe)
    mem = random_ids(2, 2, 8, vocab=496, seed=1)

    tiny_moe.save_pretrained(tmp_path / "run")
    saved = load_file(tmp_path / "run" / WEIGHTS_NAME)
    assert {n for n in saved if ".mlp.experts." in n} == {n for n, _ in tiny_moe.named_parameters()
                                                          if ".mlp.experts." in n and "lora_" in n}
    assert all("lora_" in n or ".cross_attention." in n or n.startswith("memory_projection.") for n in saved)
    config = json.loads((tmp_path / "run" / "awareness_config.json").read_text())
    assert config["lora"]["decoder"]["targets"][-1] == EXPERTS
    reloaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    torch.testing.assert_close(logits(reloaded, memory_input_ids=mem), logits(tiny_moe, memory_input_ids=mem),
                               rtol=0, atol=0)

    out = tiny_moe.save_pretrained(tmp_path / "merged", merged=True)
    merged = AwarenessModel.from_pretrained(out).eval()
    torch.testing.assert_close(logits(merged, memory_input_ids=mem), logits(tiny_moe, memory_input_ids=mem),
                               rtol=1e-5, atol=1e-5)
    # decoder/ is a plain Qwen3-MoE checkpoint: with the gates closed the LoRA model equals it
    for block in tiny_moe.gca_blocks().values():
        block.gate.data.zero_()
    plain = Qwen3MoeForCausalLM.from_pretrained(out / "decoder").eval()
    torch.testing.assert_close(logits(plain), logits(tiny_moe), rtol=1e-5, atol=1e-5)
    original = Qwen3MoeForCausalLM.from_pretrained(checkpoint_root / "tiny-qwen3-moe").eval()
    layer = "model.layers.0.mlp.experts"
    assert not torch.allclose(plain.get_parameter(f"{layer}.down_proj"), original.get_parameter(f"{layer}.down_proj"))


def test_expert_targets_are_refused_where_they_cannot_work(tiny, tiny_moe):
    with pytest.raises(ValueError, match="'experts' needs a Qwen3-MoE decoder, and this decoder is dense: target "
                                         "its MLP with gate_proj, up_proj, down_proj"):
        apply_lora(tiny, LoraPlan(decoder=LoraSettings(targets=ATTENTION + (EXPERTS,))))
    assert not any("lora_" in n for n, _ in tiny.named_parameters())  # refused before anything was injected
    with pytest.raises(ValueError, match="`experts` is a decoder target"):
        apply_lora(tiny_moe, LoraPlan(decoder=None, gca=LoraSettings(targets=(EXPERTS,))))
    with pytest.raises(ValueError, match="experts allows no dropout.*set dropout=0 in all groups, got 0.1"):
        apply_lora(tiny_moe, LoraPlan(decoder=LoraSettings(targets=(EXPERTS,)),
                                      gca=LoraSettings(dropout=0.1, targets=ATTENTION)))
