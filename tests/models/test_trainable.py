"""PEFT LoRA on decoder / GCA / encoder, and the one function that decides what trains."""

import pytest
import torch
from peft.tuners.lora import LoraLayer

from models import LoraPlan, LoraSettings, apply_lora, set_trainable
from models.trainable import ATTENTION, trainable_modes
from tests.conftest import open_gates, random_ids


def lora_ranks(model) -> dict[str, int]:
    return {n: m.r["default"] for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_lora_groups_get_their_own_modules_and_ranks(tiny):
    apply_lora(tiny, LoraPlan(decoder=LoraSettings(rank=4), gca=LoraSettings(rank=2, targets=ATTENTION),
                              encoder=LoraSettings(rank=3, targets=("q_proj", "v_proj"))))
    ranks = lora_ranks(tiny)
    decoder = {n: r for n, r in ranks.items() if n.startswith("decoder.") and ".cross_attention." not in n}
    gca = {n: r for n, r in ranks.items() if ".cross_attention." in n}
    encoder = {n: r for n, r in ranks.items() if n.startswith("memory_encoder.")}
    assert len(decoder) == 4 * 7 and set(decoder.values()) == {4}  # 4 layers x (q,k,v,o,gate,up,down)
    assert "decoder.model.layers.3.decoder_layer.self_attn.q_proj" in decoder  # wrapped layers too
    assert len(gca) == 4 and set(gca.values()) == {2}
    assert len(encoder) == 2 * 2 and set(encoder.values()) == {3}
    plan = LoraPlan.of(tiny)  # read back off PEFT's layers
    assert (plan.decoder.rank, plan.decoder.alpha, plan.gca.targets, plan.encoder.targets) == (4, 8, ATTENTION,
                                                                                               ("q_proj", "v_proj"))
    assert not hasattr(tiny.config, "lora")  # nothing is recorded beside the modules


def test_fresh_lora_keeps_the_outputs_and_trains_only_its_group(tiny):
    open_gates(tiny)
    ids = random_ids(2, 9, vocab=512, seed=0)
    mem = random_ids(2, 2, 8, vocab=496, seed=1)
    with torch.no_grad():
        before = tiny(input_ids=ids, memory_input_ids=mem).logits
    apply_lora(tiny, LoraPlan(decoder=LoraSettings(rank=4, targets=ATTENTION)))
    with torch.no_grad():
        torch.testing.assert_close(tiny(input_ids=ids, memory_input_ids=mem).logits, before, rtol=0, atol=0)
    counts = set_trainable(tiny, decoder="lora", encoder="frozen", gca="full")
    q = o = 4 * 64 + 64 * 4  # A: rank x in, B: out x rank (hidden 64, 4 heads x 16)
    k = v = 4 * 64 + 32 * 4  # 2 kv heads x 16
    assert counts["decoder"] == 4 * (q + k + v + o)
    tiny.train()
    tiny(input_ids=ids, labels=ids, memory_input_ids=mem).loss.backward()
    with_grad = {n for n, p in tiny.named_parameters() if p.grad is not None}
    assert with_grad == {n for n, p in tiny.named_parameters() if p.requires_grad}
    assert any("lora_B" in n for n in with_grad) and not any(n.startswith("memory_encoder.") for n in with_grad)
    assert not any("lora_" not in n and n.startswith("decoder.") and ".cross_attention." not in n for n in with_grad)


def test_train_modes(tiny):
    apply_lora(tiny, LoraPlan(decoder=None, gca=LoraSettings(rank=2, targets=ATTENTION)))
    counts = set_trainable(tiny, decoder="full", encoder="frozen", gca="lora")
    trainable = {n for n, p in tiny.named_parameters() if p.requires_grad}
    gca = {n for n in trainable if ".cross_attention." in n}
    assert all("lora_" in n or n.endswith(".gate") for n in gca) and any(n.endswith(".gate") for n in gca)
    assert "decoder.model.embed_tokens.weight" in trainable and counts["encoder"] == 0
    assert trainable_modes(tiny) == {"decoder": "full", "encoder": "frozen", "gca": "lora"}
    assert not hasattr(tiny.config, "trainable")


def test_modes_set_by_hand_are_refused(tiny):
    tiny.decoder.model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="decoder parameters fits no train mode"):
        trainable_modes(tiny)


def test_bad_train_settings_are_refused(tiny):
    with pytest.raises(ValueError, match="decoder='lora' needs LoRA adapters: call apply_lora"):
        set_trainable(tiny, decoder="lora")
    with pytest.raises(ValueError, match="must be one of"):
        set_trainable(tiny, encoder="half")
    with pytest.raises(ValueError, match="subset of"):
        apply_lora(tiny, LoraPlan(decoder=LoraSettings(targets=("qkv",))))


def test_moe_decoder_takes_attention_lora(tiny_moe):
    apply_lora(tiny_moe, LoraPlan(decoder=LoraSettings(rank=4, targets=ATTENTION)))
    assert len(lora_ranks(tiny_moe)) == 4 * 4
