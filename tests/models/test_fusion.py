"""The three fusions (models/fusion.py) on the same tiny pairs: parity with transformers' decoder when the memory can
have no effect, cached = full decoding, padding, gradients, save/load and meta-device parameter counts."""

import pytest
import torch
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

from models import AwarenessModel, LoraPlan, LoraSettings, apply_lora, build_pair, gca_parameter_count, set_trainable
from models.fusion import FUSIONS
from tests.conftest import random_ids
from tests.models.test_awareness import cached_logits

DEC_VOCAB, ENC_VOCAB = 512, 496
REFERENCES = {"tiny": (Qwen3ForCausalLM, "tiny-qwen3"), "tiny-moe": (Qwen3MoeForCausalLM, "tiny-qwen3-moe")}


def pair(checkpoint_root, fusion, name="tiny", **kwargs) -> AwarenessModel:
    torch.manual_seed(0)
    return build_pair(name, checkpoint_root=checkpoint_root, fusion=fusion, **kwargs).eval()


@torch.no_grad()
def reading(model: AwarenessModel) -> AwarenessModel:
    """Makes the memory matter: GCA gates open, the cross-attention's zero o_proj random (merged reads it already)."""
    if model.fusion == "gca":
        model.set_gates(1.0)
    if model.fusion == "cross":
        generator = torch.Generator().manual_seed(3)
        for module in model.memory_readers().values():
            module.o_proj.weight.copy_(torch.randn(module.o_proj.weight.shape, generator=generator) * 0.3)
    return model


def memory_batch(b=2, chunks=3, length=8, seed=1):
    ids = random_ids(b, chunks, length, vocab=ENC_VOCAB, seed=seed)
    return ids, torch.ones_like(ids)


def logits(model, ids, mem=None, mask=None, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask, **kwargs).logits


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_at_init_with_nothing_to_read_it_is_the_pretrained_decoder(checkpoint_root, fusion, name):
    """gca: gates at 0; cross: o_proj at 0; merged: the memory all padding (it reads real memory from the start)."""
    model = pair(checkpoint_root, fusion, name)
    cls, directory = REFERENCES[name]
    reference = cls.from_pretrained(checkpoint_root / directory).eval()
    ids = random_ids(2, 12, vocab=DEC_VOCAB, seed=0)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # left padding
    mem, mask = memory_batch()
    if fusion == "merged":
        mask = torch.zeros_like(mask)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()  # a left-padded position's output is never read
    for out in (logits(model, ids, attention_mask=attention_mask),
                logits(model, ids, mem, mask, attention_mask=attention_mask)):
        torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-5)
    if fusion != "gca":  # and the memory is read once it can be
        changed = logits(reading(model), ids, mem, torch.ones_like(mask), attention_mask=attention_mask)
        assert (changed[real] - expected[real]).abs().max() > 1e-3


@pytest.mark.parametrize("fusion", FUSIONS)
def test_cached_decoding_equals_a_full_forward(checkpoint_root, fusion):
    model = reading(pair(checkpoint_root, fusion))
    prompt, continuation = random_ids(2, 6, vocab=DEC_VOCAB, seed=0), random_ids(2, 5, vocab=DEC_VOCAB, seed=1)
    mem, mask = memory_batch()
    mask[1, 2, 3:] = 0
    full = logits(model, torch.cat([prompt, continuation], dim=1), mem, mask)
    torch.testing.assert_close(cached_logits(model, prompt, continuation, mem, mask), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_generate_greedy_and_beams_give_each_row_its_own_answer(checkpoint_root, fusion):
    """Greedy generate is the argmax of full forwards; beam rows (expanded, reading memory i // beams) give each row
    what it gets alone."""
    model = reading(pair(checkpoint_root, fusion))
    prompt = random_ids(2, 5, vocab=DEC_VOCAB, seed=4)
    mem, mask = memory_batch(seed=5)
    mask[1, 2:] = 0  # row 1's memory is two chunks, then padding
    kwargs = dict(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    greedy = model.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, do_sample=False, **kwargs)
    ids = prompt
    for _ in range(5):
        ids = torch.cat([ids, logits(model, ids, mem, mask)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, ids)
    together = model.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, num_beams=3, **kwargs)
    for row, chunks in ((0, 3), (1, 2)):
        alone = model.generate(prompt[row : row + 1], memory_input_ids=mem[row : row + 1, :chunks],
                               memory_attention_mask=mask[row : row + 1, :chunks], num_beams=3, **kwargs)
        assert torch.equal(together[row : row + 1], alone)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_padded_memory_positions_change_nothing(checkpoint_root, fusion):
    model = reading(pair(checkpoint_root, fusion))
    ids = random_ids(2, 10, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    mask[-1, -1, 5:] = 0
    noisy = mem.clone()
    noisy[-1, -1, 5:] = random_ids(3, vocab=ENC_VOCAB, seed=9)  # other content in the padded slots
    extra, extra_mask = (torch.cat([x, torch.zeros_like(x[:, :1])], dim=1) for x in (mem, mask))  # + a padding chunk
    base = logits(model, ids, mem, mask)
    for m, mm in ((noisy, mask), (extra, extra_mask)):
        torch.testing.assert_close(logits(model, ids, m, mm), base, rtol=1e-5, atol=1e-5)
    other = mem.clone()
    other[0, 1, 3] = (other[0, 1, 3] + 1) % ENC_VOCAB  # one real token of row 0's memory
    changed = logits(model, ids, other, mask)
    assert (changed[0] - base[0]).abs().max() > 1e-5
    torch.testing.assert_close(changed[1], base[1], rtol=0, atol=0)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_gradients_reach_encoder_and_projection_with_and_without_checkpointing(checkpoint_root, fusion):
    def grads(checkpointing):
        model = reading(pair(checkpoint_root, fusion)).train()
        set_trainable(model, decoder="full" if fusion == "merged" else "frozen", encoder="full")
        if checkpointing:
            model.gradient_checkpointing_enable()
        ids = random_ids(2, 10, vocab=DEC_VOCAB, seed=0)
        mem, mask = memory_batch()
        model(input_ids=ids, labels=ids, memory_input_ids=mem, memory_attention_mask=mask).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    for name in ("memory_projection.weight", "memory_encoder.encoder.layers.0.self_attn.q_proj.weight"):
        assert plain[name].abs().sum() > 0
    if fusion == "cross":  # the added cross-attention trains, q/k/v included once o_proj is not zero
        assert plain["decoder.model.layers.0.cross_attention.k_proj.weight"].abs().sum() > 0
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-6)


def test_cross_attention_starts_with_zero_output_and_trains_as_the_gca_group(checkpoint_root):
    model = pair(checkpoint_root, "cross")
    blocks = model.memory_readers()
    assert sorted(blocks) == [0, 1, 2, 3] and all(b.o_proj.weight.abs().sum() == 0 for b in blocks.values())
    assert all(b.q_proj.weight.std() > 0 for b in blocks.values())  # the rest is initialised as GCA blocks are
    counts = set_trainable(model)  # the default: what AwarenessModel adds trains, the pair is frozen
    added = sum(p.numel() for n, p in model.named_parameters() if ".cross_attention." in n or "memory_projection" in n)
    assert counts == {"decoder": 0, "encoder": 0, "gca": added}
    apply_lora(model, LoraPlan(decoder=LoraSettings(rank=4), gca=LoraSettings(rank=2)))
    counts = set_trainable(model, decoder="lora", gca="lora")
    assert counts["gca"] > 0 and counts["decoder"] > 0


@pytest.mark.parametrize("fusion", ["cross", "merged"])
def test_save_and_load_round_trip(checkpoint_root, tmp_path, fusion):
    model = reading(pair(checkpoint_root, fusion))
    apply_lora(model, LoraPlan(decoder=LoraSettings(rank=4)))
    set_trainable(model, decoder="lora")
    with torch.no_grad():  # trained-looking adapters and added weights
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    ids = random_ids(2, 9, vocab=DEC_VOCAB, seed=2)
    mem, mask = memory_batch()
    expected = logits(model, ids, mem, mask)
    model.save_pretrained(tmp_path / "run")
    loaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    assert loaded.fusion == fusion and loaded.gca_layers == [0, 1, 2, 3]
    torch.testing.assert_close(logits(loaded, ids, mem, mask), expected, rtol=1e-5, atol=1e-5)
    other = "gca" if fusion == "cross" else "cross"
    with pytest.raises(ValueError, match="another fusion"):
        pair(checkpoint_root, other).load_added_weights(tmp_path / "run" / "awareness.safetensors")


@pytest.mark.parametrize("name", ["small", "proto1", "prod"])
def test_meta_parameter_counts(name):
    """cross: one Qwen3-attention-shaped block (q, k, v, o, QK-norm, pre-norm) per layer plus the projection, as
    the GCA closed form gives for blocks in every layer less their gates; merged: the projection alone."""
    counts = {}
    for fusion in FUSIONS:
        model = build_pair(name, device="meta", fusion=fusion)
        counts[fusion] = sum(p.numel() for n, p in model.named_parameters() if ".cross_attention." in n
                             or n.startswith("memory_projection."))
        base = sum(p.numel() for n, p in model.named_parameters() if ".cross_attention." not in n)
        counts.setdefault("base", base)
        assert base == counts["base"]  # every fusion keeps the pair's own parameters
    d = model.decoder.config
    layers = d.num_hidden_layers
    encoder_width = model.memory_encoder.hidden_size
    projection = encoder_width * d.hidden_size if encoder_width != d.hidden_size else 0
    every_layer = gca_parameter_count(hidden_size=d.hidden_size, num_heads=d.num_attention_heads,
                                      num_kv_heads=d.num_key_value_heads, head_dim=d.head_dim, num_gca_layers=layers,
                                      encoder_hidden_size=encoder_width)
    assert counts["cross"] == every_layer - layers  # no gate
    assert counts["merged"] == projection


def test_bad_fusion_is_refused_clearly(checkpoint_root):
    with pytest.raises(ValueError, match="fusion must be one of"):
        build_pair("tiny", checkpoint_root=checkpoint_root, fusion="concat")
    with pytest.raises(ValueError, match="gca_mlp"):
        build_pair("tiny", device="meta", fusion="cross", gca_mlp=True)
