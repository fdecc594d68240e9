"""The classic cross-attention decoder: causality, cached decoding against full forwards, memory padding, gradients,
parity with Qwen3ForCausalLM when there is nothing to read, one layer against a hand-written reference (GQA, RoPE on
self-attention only), memory keys/values projected once per generation, beam search against a written-out beam
search, save/load, gradient checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from models import Qwen3CrossAttentionConfig, Qwen3CrossAttentionForCausalLM
from models.cross_attention import CrossAttentionDecoderLayer
from models.gca import MemoryPadding
from tests.conftest import random_ids

V, D, MEMORY_WIDTH = 97, 32, 24


def make_model(*, seed: int = 0, vocab: int = V, memory_width: int = MEMORY_WIDTH, tied: bool = False,
               layers: int = 2) -> Qwen3CrossAttentionForCausalLM:
    """Tiny random decoder: 4 query heads over 2 KV heads (GQA), memory narrower than the decoder; init 0.1 so
    attention is peaked and generated tokens vary."""
    config = Qwen3CrossAttentionConfig(
        vocab_size=vocab, hidden_size=D, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, memory_hidden_size=memory_width,
        tie_word_embeddings=tied, initializer_range=0.1, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen3CrossAttentionForCausalLM(config).eval()


def memory(batch: int, length: int, *, seed: int, width: int = MEMORY_WIDTH) -> torch.Tensor:
    return torch.randn(batch, length, width, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model() -> Qwen3CrossAttentionForCausalLM:
    return make_model()


def logits(model, ids, mem, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, memory=mem, **kwargs).logits


# ------------------------------------------------------------------------------------------------ forward
def test_future_tokens_never_change_past_logits(model):
    ids, mem = random_ids(2, 12, vocab=V, seed=1), memory(2, 7, seed=2)
    changed = ids.clone()
    changed[:, 6:] = random_ids(2, 6, vocab=V, seed=3)
    before, after = logits(model, ids, mem), logits(model, changed, mem)
    torch.testing.assert_close(before[:, :6], after[:, :6], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(before[:, 6:], after[:, 6:], atol=1e-3)


def test_memory_is_read(model):
    ids = random_ids(2, 8, vocab=V, seed=1)
    assert not torch.allclose(logits(model, ids, memory(2, 7, seed=2)), logits(model, ids, memory(2, 7, seed=3)),
                              atol=1e-3)


def test_padded_memory_positions_change_nothing(model):
    """Appending padding (any values) with a mask gives the same logits as the unpadded memory, row by row."""
    ids, mem = random_ids(2, 9, vocab=V, seed=1), memory(2, 7, seed=2)
    want = logits(model, ids, mem)
    padded = torch.cat([mem, 100 * memory(2, 5, seed=3)], dim=1)  # (2, 12, W): 5 junk positions per row
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, 7:] = False
    torch.testing.assert_close(logits(model, ids, padded, memory_mask=mask), want, atol=1e-5, rtol=1e-5)
    mask[1, 4:7] = False  # the second row's memory is shorter still: it equals that row alone on its 4 tokens
    alone = logits(model, ids[1:], mem[1:, :4])
    torch.testing.assert_close(logits(model, ids, padded, memory_mask=mask)[1:], alone, atol=1e-5, rtol=1e-5)


def test_fully_padded_memory_row_reads_nothing(model):
    """A row with no real memory token gets finite logits, equal to a zeroed cross-attention output."""
    ids, mem = random_ids(2, 6, vocab=V, seed=1), memory(2, 5, seed=2)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0] = False
    out = logits(model, ids, mem, memory_mask=mask)
    assert torch.isfinite(out).all()
    for layer in model.model.layers:  # zero the cross-attention output: the model without a memory
        torch.nn.init.zeros_(layer.cross_attn.o_proj.weight)
    torch.testing.assert_close(out[0], logits(model, ids, mem)[0], atol=1e-5, rtol=1e-5)


def test_gradients_reach_the_memory_and_every_parameter(model):
    model.train()
    mem = memory(2, 7, seed=2).requires_grad_()
    ids = random_ids(2, 8, vocab=V, seed=1)
    model(ids, memory=mem, labels=ids).loss.backward()
    assert mem.grad is not None and mem.grad.abs().sum() > 0
    missing = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not missing, f"no gradient for {missing}"


def test_with_no_memory_to_read_it_is_qwen3_on_qwen3_weights():
    """Self-attention, MLP and norms are Qwen3's under Qwen3's names: a Qwen3ForCausalLM state dict loads by name
    (only the cross-attention and the projection are new), and with every memory position masked the logits are
    Qwen3ForCausalLM's."""
    model = make_model()
    fields = {k: v for k, v in model.config.to_dict().items()
              if k not in ("model_type", "memory_hidden_size", "architectures", "transformers_version")}
    torch.manual_seed(1)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**fields)).eval()
    result = model.load_state_dict(qwen3.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(".cross_attn" in k or "memory_projection" in k for k in result.missing_keys), result.missing_keys
    ids = random_ids(2, 9, vocab=V, seed=1)
    got = logits(model, ids, memory(2, 5, seed=2), memory_mask=torch.zeros(2, 5, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(got, qwen3(ids).logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- one layer, written out
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, H, T, hd) rotated by positions 0..T-1 (halves layout, as Qwen3)."""
    hd, t = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)  # (hd/2,)
    angles = torch.arange(t).float()[:, None] * inv_freq[None]  # (T, hd/2)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # (T, hd)
    rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)
    return x * cos + rotated * sin


def reference_attention(q, k, v, allowed: torch.Tensor) -> torch.Tensor:
    """q (B, H, T, hd), k/v (B, H_kv, S, hd), allowed (B, 1, T, S) -> (B, T, H*hd): GQA by repeating KV heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, hd)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5  # (B, H, T, S)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (weights @ v).transpose(1, 2).flatten(2)


def reference_layer(layer: CrossAttentionDecoderLayer, x, mem, mem_mask, *, theta: float, eps: float):
    """x (B, T, d), mem (B, M, d) -> (B, T, d), from the layer's weights alone."""
    b, t, _ = x.shape
    hd, sa, ca = layer.self_attn.head_dim, layer.self_attn, layer.cross_attn

    def heads(proj, states, norm=None):  # (B, L, d) -> (B, heads, L, hd)
        y = F.linear(states, proj.weight).view(b, states.shape[1], -1, hd)
        return (rms(y, norm.weight, eps) if norm is not None else y).transpose(1, 2)

    h = rms(x, layer.input_layernorm.weight, eps)
    q, k = rope(heads(sa.q_proj, h, sa.q_norm), theta), rope(heads(sa.k_proj, h, sa.k_norm), theta)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]  # (1, 1, T, T)
    x = x + F.linear(reference_attention(q, k, heads(sa.v_proj, h), causal), sa.o_proj.weight)
    h = rms(x, layer.cross_attn_layernorm.weight, eps)
    q = heads(ca.q_proj, h, ca.q_norm)  # no RoPE on either side of the cross-attention
    k, v = heads(ca.k_proj, mem, ca.k_norm), heads(ca.v_proj, mem)
    x = x + F.linear(reference_attention(q, k, v, mem_mask[:, None, None, :]), ca.o_proj.weight)
    h = rms(x, layer.post_attention_layernorm.weight, eps)
    mlp = layer.mlp
    return x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                        mlp.down_proj.weight)


def test_layer_equals_hand_written_reference(model):
    layer, config = model.model.layers[1], model.config
    x, mem = torch.randn(2, 6, D), torch.randn(2, 5, D)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    positions = torch.arange(6)[None]
    with torch.no_grad():
        got = layer(x, mem, memory_padding=MemoryPadding.from_mask(mask), attention_mask=None,
                    position_embeddings=model.model.rotary_emb(x, positions))
        want = reference_layer(layer, x, mem, mask, theta=config.rope_parameters["rope_theta"],
                               eps=config.rms_norm_eps)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------- cache, generate
def test_cached_logits_step_by_step_equal_a_full_forward(model):
    ids, mem = random_ids(2, 10, vocab=V, seed=1), memory(2, 7, seed=2)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    full = logits(model, ids, mem, memory_mask=mask)
    with torch.no_grad():
        out = model(ids[:, :4], memory=mem, memory_mask=mask, use_cache=True)
        steps = [out.logits]
        for i in range(4, 10):
            out = model(ids[:, i:i + 1], memory=None, memory_mask=mask, cache=out.cache,
                        use_cache=True)  # the memory is no longer needed: its keys/values are cached
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_greedy_generate_equals_argmax_of_full_forwards(model):
    ids, mem = random_ids(2, 5, vocab=V, seed=1), memory(2, 7, seed=2)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, 6:] = False
    generated = model.generate(ids, memory=mem, memory_mask=mask, max_new_tokens=10, do_sample=False)
    want = ids
    for _ in range(10):  # no cache: the whole sequence again at every step
        next_token = logits(model, want, mem, memory_mask=mask)[:, -1].argmax(-1, keepdim=True)
        want = torch.cat([want, next_token], dim=1)
    assert torch.equal(generated, want)
    assert torch.equal(model.generate(ids, memory=mem, memory_mask=mask, max_new_tokens=10, do_sample=False,
                                      use_cache=False), want)


def test_left_padded_prompts_generate_as_each_row_alone(model):
    """Padded prompt tokens stay masked out of self-attention at every cached step. (Positions count real tokens,
    but RoPE is relative, so a uniform shift would not show here: this checks the masking.)"""
    mem = memory(2, 7, seed=2)
    short, long = random_ids(1, 3, vocab=V, seed=1), random_ids(1, 6, vocab=V, seed=3)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1), long])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    together = model.generate(batch, attention_mask=mask, memory=mem, max_new_tokens=6, do_sample=False)
    for row, prompt in enumerate((short, long)):
        alone = model.generate(prompt, memory=mem[row:row + 1], max_new_tokens=6, do_sample=False)
        assert torch.equal(together[row, 6:], alone[0, prompt.shape[1]:])


def test_memory_keys_values_projected_once_per_generation(model):
    calls: dict[str, int] = {}

    def count(name):
        def hook(module, args, output):
            calls[name] = calls.get(name, 0) + 1
        return hook

    handles = [model.model.memory_projection.register_forward_hook(count("memory_projection"))]
    for i, layer in enumerate(model.model.layers):
        handles += [layer.cross_attn.k_proj.register_forward_hook(count(f"{i}.k")),
                    layer.cross_attn.v_proj.register_forward_hook(count(f"{i}.v")),
                    layer.cross_attn.q_proj.register_forward_hook(count(f"{i}.q"))]
    ids, mem = random_ids(2, 5, vocab=V, seed=1), memory(2, 7, seed=2)
    for num_beams in (1, 3):
        calls.clear()
        out = model.generate(ids, memory=mem, max_new_tokens=10, min_new_tokens=10, num_beams=num_beams)
        assert out.shape == (2, 15)
        assert calls.pop("memory_projection") == 1
        assert all(calls.pop(f"{i}.{kv}") == 1 for i in range(2) for kv in "kv"), calls
        assert all(n == 10 for n in calls.values()), calls  # queries: one forward per generated token
    for handle in handles:
        handle.remove()


def hand_beam_search(model, prompt, mem, *, num_beams: int, steps: int) -> torch.Tensor:
    """Beam search written out, every step a full forward without cache: keep the `num_beams` best sums of
    log-probabilities. prompt (T,), mem (M, W) -> the best continuation (steps,)."""
    beams, scores = prompt[None], torch.zeros(1)  # (n, T + s), (n,)
    for _ in range(steps):
        logp = logits(model, beams, mem.expand(len(beams), -1, -1))[:, -1].log_softmax(-1)  # (n, V)
        total = (scores[:, None] + logp).flatten()  # (n*V,)
        scores, flat = total.topk(num_beams)
        beams = torch.cat([beams[flat // logp.shape[1]], (flat % logp.shape[1])[:, None]], dim=1)
    return beams[0, len(prompt):]


def test_beam_search_equals_a_hand_written_beam_search():
    """Without EOS and with length_penalty=0 a beam's score is its sum of log-probabilities, so transformers' beam
    search must keep the same beams as the written-out one; from the second generated token on, beams come from
    different parents, so this also checks that the cache is reordered with them."""
    vocab = 16
    model = make_model(vocab=vocab, seed=4)
    ids, mem = random_ids(2, 4, vocab=vocab, seed=1), memory(2, 6, seed=2)
    best = model.generate(ids, memory=mem, max_new_tokens=5, num_beams=3, do_sample=False, length_penalty=0.0)
    for row in range(2):
        assert torch.equal(best[row, 4:], hand_beam_search(model, ids[row], mem[row], num_beams=3, steps=5))


def test_one_beam_equals_greedy_and_sampling_runs(model):
    ids, mem = random_ids(2, 5, vocab=V, seed=1), memory(2, 7, seed=2)
    greedy = model.generate(ids, memory=mem, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, memory=mem, max_new_tokens=8, num_beams=1, do_sample=False), greedy)
    beams = model.generate(ids, memory=mem, max_new_tokens=8, num_beams=4, num_return_sequences=2)
    assert beams.shape == (4, 13) and torch.equal(beams[:, :5], ids.repeat_interleave(2, dim=0))
    torch.manual_seed(0)
    sampled = model.generate(ids, memory=mem, max_new_tokens=8, do_sample=True, top_k=20)
    assert sampled.shape == (2, 13) and torch.equal(sampled[:, :5], ids)


# ------------------------------------------------------------------------------------------- save, train
@pytest.mark.parametrize(("tied", "memory_width"), [(False, MEMORY_WIDTH), (True, D)])
def test_save_pretrained_round_trip(tmp_path, tied, memory_width):
    model = make_model(tied=tied, memory_width=memory_width)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert ("model.memory_projection.weight" in saved) == (memory_width != D)
    loaded = Qwen3CrossAttentionForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded.config, Qwen3CrossAttentionConfig) and loaded.config.memory_hidden_size == memory_width
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    ids, mem = random_ids(2, 8, vocab=V, seed=1), memory(2, 5, seed=2, width=memory_width)
    assert torch.equal(logits(loaded, ids, mem), logits(model, ids, mem))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    ids, mem = random_ids(2, 8, vocab=V, seed=1), memory(2, 7, seed=2)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, 5:] = False
    results = []
    for checkpointing in (False, True):
        model = make_model().train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        mem_leaf = mem.clone().requires_grad_()
        loss = model(ids, memory=mem_leaf, memory_mask=mask, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), mem_leaf.grad, {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, mem_a, grads_a), (loss_b, mem_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(mem_b, mem_a)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], msg=name)


def test_invalid_inputs_are_named():
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen3CrossAttentionConfig(use_sliding_window=True)
    model = make_model()
    with pytest.raises(ValueError, match="needs `memory`"):
        model(random_ids(1, 3, vocab=V, seed=0))
    with pytest.raises(ValueError, match="memory_mask has shape"):
        model(random_ids(1, 3, vocab=V, seed=0), memory=memory(1, 4, seed=0), memory_mask=torch.ones(4))
