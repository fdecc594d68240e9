"""Qwen3ForSeq2SeqLM: merged attention checked against a written-out reference, parity with Qwen3ForCausalLM after
from_qwen3, padding, caching, generation (greedy / beam / sampling), save/load, resize, encoder extraction, and the
extracted encoder as the Awareness memory encoder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from models import AwarenessModel, Qwen3EncoderDecoderConfig, Qwen3EncoderModel, Qwen3ForSeq2SeqLM, build_pair
from models.loading import load_encoder
from models.specs import TINY_DECODER
from models.seq2seq.model import Qwen3MergedAttention, merged_attention_mask
from tests.conftest import random_ids

V = TINY_DECODER["vocab_size"]
START = 1


def write_qwen3(directory: Path, *, seed: int, init: float = 0.1, tied: bool = True) -> Path:
    """A random decoder-only Qwen3 checkpoint; init 0.1 (not 0.02) so attention is peaked and tokens vary."""
    fields = {k: v for k, v in TINY_DECODER.items() if k != "model_type"}
    fields.update(initializer_range=init, tie_word_embeddings=tied, bos_token_id=START, pad_token_id=0)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**fields)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return write_qwen3(tmp_path_factory.mktemp("qwen3"), seed=0)


@pytest.fixture
def model(qwen3_dir) -> Qwen3ForSeq2SeqLM:
    torch.manual_seed(0)
    return Qwen3ForSeq2SeqLM.from_qwen3(qwen3_dir)


def logits(model, enc, dec, enc_mask=None, dec_mask=None):
    with torch.no_grad():
        return model(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                     decoder_attention_mask=dec_mask).logits


# ---------------------------------------------------------------------------------------------- initialisation
@pytest.mark.parametrize("tied", [True, False])
def test_encoder_masked_out_equals_qwen3_causal_lm(tmp_path, tied):
    """The T5Gemma recipe's starting point: with nothing to read in the encoder, the decoder is the base model."""
    path = write_qwen3(tmp_path, seed=3, tied=tied)
    torch.manual_seed(0)
    base = Qwen3ForCausalLM.from_pretrained(path).eval()
    torch.manual_seed(0)
    model = Qwen3ForSeq2SeqLM.from_qwen3(path)
    enc, dec = random_ids(2, 9, vocab=V, seed=1), random_ids(2, 11, vocab=V, seed=2)
    got = logits(model, enc, dec, enc_mask=torch.zeros_like(enc))
    with torch.no_grad():
        want = base(dec).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (model.lm_head.weight is model.encoder.embed_tokens.weight) == tied
    assert model.decoder.embed_tokens.weight is model.encoder.embed_tokens.weight
    assert not torch.allclose(logits(model, enc, dec), want, atol=1e-3)  # an unmasked encoder is read


def rope_kl(path: Path, rope: str, prefix: int = 16) -> float:
    """KL(base(prefix + rest) || seq2seq(encoder=prefix, decoder=rest)) per predicted token: how well the
    initialised seq2seq model reproduces the decoder-only model it came from when the prefix moves to the encoder."""
    base = Qwen3ForCausalLM.from_pretrained(path).eval()
    model = Qwen3ForSeq2SeqLM.from_qwen3(path, encoder_key_rope=rope)
    x = random_ids(8, 2 * prefix, vocab=V, seed=5)
    with torch.no_grad():
        want = F.log_softmax(base(x).logits[:, prefix:], -1)
        got = F.log_softmax(logits(model, x[:, :prefix], x[:, prefix:]), -1)
    return F.kl_div(got, want, log_target=True, reduction="none").sum(-1).mean().item()


def test_rope_decision(tmp_path):
    """The default (no RoPE on encoder keys, as T5Gemma 2) reproduces the base model better than rotating encoder
    keys by their own positions, which overlap the decoder's and so look like future tokens to a causal model."""
    for seed in (0, 1):
        path = write_qwen3(tmp_path / str(seed), seed=seed)
        none, positions = rope_kl(path, "none"), rope_kl(path, "encoder_positions")
        print(f"seed {seed}: KL none={none:.5f} encoder_positions={positions:.5f}")
        assert none < positions
    assert Qwen3EncoderDecoderConfig().encoder_key_rope == "none"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("AWARENESS_CHECKPOINT_ROOT"),
                    reason="needs $AWARENESS_CHECKPOINT_ROOT/Qwen3-0.6B")
def test_rope_decision_on_qwen3_0_6b():
    path = Path(os.environ["AWARENESS_CHECKPOINT_ROOT"]) / "Qwen3-0.6B"
    none, positions = rope_kl(path, "none"), rope_kl(path, "encoder_positions")
    print(f"Qwen3-0.6B: KL none={none:.5f} encoder_positions={positions:.5f}")
    assert none <= positions


# ----------------------------------------------------------------------------------------------- the attention
def reference_merged_attention(attn: Qwen3MergedAttention, x, enc, cos, sin, mask):
    """Written out with matmul + softmax: QK-norm before RoPE, GQA by repeating kv heads, no RoPE on encoder keys."""
    b, t, _ = x.shape
    hd, nh, nkv = attn.head_dim, attn.config.num_attention_heads, attn.config.num_key_value_heads
    q = attn.q_norm(attn.q_proj(x).view(b, t, nh, hd)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(b, t, nkv, hd)).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, nkv, hd).transpose(1, 2)
    rot = lambda u: torch.cat([-u[..., hd // 2:], u[..., : hd // 2]], -1)  # noqa: E731
    q, k = q * cos[:, None] + rot(q) * sin[:, None], k * cos[:, None] + rot(k) * sin[:, None]
    ek = attn.k_norm(attn.k_proj(enc).view(b, enc.shape[1], nkv, hd)).transpose(1, 2)
    ev = attn.v_proj(enc).view(b, enc.shape[1], nkv, hd).transpose(1, 2)
    k = torch.cat([k, ek], 2).repeat_interleave(nh // nkv, 1)
    v = torch.cat([v, ev], 2).repeat_interleave(nh // nkv, 1)
    scores = (q @ k.transpose(-1, -2)) * hd**-0.5
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return attn.o_proj((weights @ v).transpose(1, 2).reshape(b, t, -1)), weights


def test_merged_attention_matches_reference_with_qk_norm_and_gqa(model):
    """SDPA path and eager path equal the written-out attention, with non-trivial QK-norm weights and 2 query heads
    per kv head; the weights are causal over the decoder, full over unpadded encoder tokens."""
    attn = model.decoder.layers[1].self_attn
    assert attn.config.num_attention_heads == 2 * attn.config.num_key_value_heads  # GQA
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 2.0)
        attn.k_norm.weight.uniform_(0.5, 2.0)
    gen = torch.Generator().manual_seed(0)
    x, enc = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 6, 64, generator=gen)
    enc_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2]).bool()
    mask = merged_attention_mask(torch.ones(2, 5, dtype=torch.bool), enc_mask, 5)
    cos, sin = model.decoder.rotary_emb(x, torch.arange(5)[None].expand(2, -1))
    want, want_w = reference_merged_attention(attn, x, enc, cos, sin, mask)
    with torch.no_grad():
        got, none = attn(x, (cos, sin), mask, encoder_hidden_states=enc)
        eager, weights = attn(x, (cos, sin), mask, encoder_hidden_states=enc, output_attentions=True)
    assert none is None  # weights are materialised only on request
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    self_part, cross_part = weights[..., :5], weights[..., 5:]
    assert torch.all(self_part.triu(1) == 0)  # causal decoder -> decoder
    assert torch.all(cross_part[0] > 0)  # full decoder -> encoder
    assert torch.all(cross_part[1, ..., 4:] == 0) and torch.all(cross_part[1, ..., :4] > 0)  # encoder padding
    with torch.no_grad():
        attn.k_norm.weight.mul_(3.0)  # QK-norm is on the path: changing it changes the output
        changed, _ = attn(x, (cos, sin), mask, encoder_hidden_states=enc)
    assert not torch.allclose(changed, got, atol=1e-4)


def test_causal_decoder_and_full_encoder(model):
    enc, dec = random_ids(1, 8, vocab=V, seed=1), random_ids(1, 6, vocab=V, seed=2)
    base = logits(model, enc, dec)
    later = dec.clone()
    later[0, 4] = (later[0, 4] + 1) % V
    out = logits(model, enc, later)
    torch.testing.assert_close(out[:, :4], base[:, :4])  # decoder positions before the change cannot see it
    assert not torch.allclose(out[:, 4:], base[:, 4:], atol=1e-4)
    last = enc.clone()
    last[0, -1] = (last[0, -1] + 1) % V
    out = logits(model, last, dec)
    assert not torch.allclose(out[:, 0], base[:, 0], atol=1e-4)  # the first decoder token reads the last encoder token
    with torch.no_grad():
        first_state = lambda ids: model.encoder(input_ids=ids).last_hidden_state[:, 0]  # noqa: E731
        assert not torch.allclose(first_state(last), first_state(enc), atol=1e-4)  # bidirectional encoder


def test_padding_on_both_sides_has_no_effect(model):
    enc, dec = random_ids(1, 7, vocab=V, seed=3), random_ids(1, 5, vocab=V, seed=4)
    want = logits(model, enc, dec)
    pad = torch.zeros(1, 3, dtype=torch.long)
    ones, zeros = torch.ones(1, 7, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)
    for enc_ids, enc_mask in ((torch.cat([pad, enc], 1), torch.cat([zeros, ones], 1)),
                              (torch.cat([enc, pad], 1), torch.cat([ones, zeros], 1))):
        torch.testing.assert_close(logits(model, enc_ids, dec, enc_mask=enc_mask), want, atol=1e-5, rtol=1e-5)
    dec_left, dec_mask = torch.cat([pad, dec], 1), torch.cat([zeros, torch.ones(1, 5, dtype=torch.long)], 1)
    got = logits(model, enc, dec_left, dec_mask=dec_mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:, 3:], want, atol=1e-5, rtol=1e-5)


def test_gradient_flows_into_encoder(model):
    model.train()
    enc, labels = random_ids(2, 8, vocab=V, seed=5), random_ids(2, 6, vocab=V, seed=6)
    out = model(input_ids=enc, labels=labels)
    out.loss.backward()
    for layer in model.encoder.layers:
        assert layer.self_attn.q_proj.weight.grad is not None and layer.self_attn.q_proj.weight.grad.abs().sum() > 0
        assert layer.mlp.down_proj.weight.grad.abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients(model):
    enc, labels = random_ids(2, 8, vocab=V, seed=5), random_ids(2, 6, vocab=V, seed=6)
    model.train()
    model(input_ids=enc, labels=labels).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing_enable()  # the name the UL2 recipe calls (transformers deprecates the gradient_ one)
    assert model.is_activation_checkpointing
    model(input_ids=enc, labels=labels).loss.backward()
    for name, grad in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-5, rtol=1e-4)


def test_loss_shifts_labels_behind_the_start_token(model):
    enc, labels = random_ids(2, 8, vocab=V, seed=5), random_ids(2, 6, vocab=V, seed=6)
    labels[1, -2:] = -100
    decoder_inputs = model.prepare_decoder_input_ids_from_labels(labels)
    assert decoder_inputs[:, 0].tolist() == [START, START]
    assert torch.equal(decoder_inputs[0, 1:], labels[0, :-1])
    assert decoder_inputs[1, -1].item() == model.config.pad_token_id  # a -100 shifted in becomes padding
    with torch.no_grad():
        out = model(input_ids=enc, labels=labels)
        manual = model(input_ids=enc, decoder_input_ids=decoder_inputs).logits
    want = F.cross_entropy(manual.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, want)


def test_output_attentions_and_hidden_states(model):
    enc, dec = random_ids(2, 7, vocab=V, seed=1), random_ids(2, 4, vocab=V, seed=2)
    with torch.no_grad():
        out = model(input_ids=enc, decoder_input_ids=dec, output_attentions=True, output_hidden_states=True)
        plain = model(input_ids=enc, decoder_input_ids=dec)
    layers = model.config.num_hidden_layers
    assert len(out.decoder_attentions) == len(out.cross_attentions) == len(out.encoder_attentions) == layers
    assert out.decoder_attentions[0].shape == (2, 4, 4, 4) and out.cross_attentions[0].shape == (2, 4, 4, 7)
    total = out.decoder_attentions[0].sum(-1) + out.cross_attentions[0].sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total))  # one softmax over decoder and encoder keys
    torch.testing.assert_close(out.encoder_attentions[0].sum(-1), torch.ones(2, 4, 7))
    assert len(out.decoder_hidden_states) == len(out.encoder_hidden_states) == layers + 1
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-5, rtol=1e-5)  # eager == SDPA


# -------------------------------------------------------------------------------------------------- decoding
def test_cached_decoding_equals_full_forward_and_projects_encoder_once(model):
    enc, dec = random_ids(2, 7, vocab=V, seed=7), random_ids(2, 6, vocab=V, seed=8)
    full = logits(model, enc, dec)
    projections = []
    for layer in model.decoder.layers:
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: projections.append(i[0].shape[1]))
    with torch.no_grad():
        encoder_outputs = model.encoder(input_ids=enc)
        out = model(encoder_outputs=encoder_outputs, decoder_input_ids=dec[:, :3], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(3, 6):
            out = model(encoder_outputs=encoder_outputs, decoder_input_ids=dec[:, t : t + 1], cache=cache,
                        use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    layers = model.config.num_hidden_layers
    assert projections.count(7) == layers  # the encoder's keys: projected once per layer for the whole decode
    assert cache.cross_attention_cache.get_seq_length() == 7 and cache.self_attention_cache.get_seq_length() == 6


def greedy_reference(model, enc, enc_mask, steps: int) -> torch.Tensor:
    dec = torch.full((enc.shape[0], 1), START)
    for _ in range(steps):
        nxt = logits(model, enc, dec, enc_mask=enc_mask)[:, -1].argmax(-1, keepdim=True)
        dec = torch.cat([dec, nxt], 1)
    return dec


def test_greedy_generation_equals_argmax_of_full_forwards(model):
    enc = random_ids(2, 7, vocab=V, seed=9)
    enc_mask = torch.tensor([[1] * 7, [0, 0] + [1] * 5])
    out = model.generate(enc, attention_mask=enc_mask, max_new_tokens=6, do_sample=False)
    want = greedy_reference(model, enc, enc_mask, 6)
    assert torch.equal(out, want)
    assert len(set(want[:, 1:].flatten().tolist())) > 2  # a real sequence, not one token repeated


def test_beam_search_is_correct_per_row(model):
    """Batch of 2 rows (one padded) with 3 beams equals each row searched alone, and each returned sequence's score
    equals its log-probability under full forwards, so the cache (self and cross) was reordered with the beams."""
    enc = random_ids(2, 7, vocab=V, seed=10)
    enc_mask = torch.tensor([[1] * 7, [0, 0, 0] + [1] * 4])
    kwargs = dict(max_new_tokens=5, num_beams=3, do_sample=False, length_penalty=0.0, early_stopping=True,
                  return_dict_in_generate=True, output_scores=True)
    batch = model.generate(enc, attention_mask=enc_mask, **kwargs)
    for row in range(2):
        keep = enc_mask[row].bool()
        alone = model.generate(enc[row : row + 1, keep], **kwargs)
        assert torch.equal(batch.sequences[row], alone.sequences[0])
        seq = batch.sequences[row : row + 1]
        lp = F.log_softmax(logits(model, enc[row : row + 1], seq[:, :-1], enc_mask=enc_mask[row : row + 1]), -1)
        total = lp.gather(-1, seq[:, 1:, None]).sum()
        torch.testing.assert_close(batch.sequences_scores[row], total, atol=1e-4, rtol=1e-4)
    greedy = model.generate(enc, attention_mask=enc_mask, max_new_tokens=5, do_sample=False)
    lp_of = lambda s: F.log_softmax(logits(model, enc, s[:, :-1], enc_mask=enc_mask), -1).gather(  # noqa: E731
        -1, s[:, 1:, None]).sum((1, 2))
    assert torch.all(lp_of(batch.sequences) >= lp_of(greedy) - 1e-4)  # beam search finds no worse sequences


def test_sampling_is_reproducible(model):
    enc = random_ids(2, 7, vocab=V, seed=11)
    sample = lambda seed: (torch.manual_seed(seed), model.generate(enc, max_new_tokens=8, do_sample=True,  # noqa: E731
                                                                   top_k=0, temperature=1.5))[1]
    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))


# ------------------------------------------------------------------------------------------ saving and sizes
def test_save_load_keeps_ties_and_values(model, tmp_path):
    model.save_pretrained(tmp_path / "s2s")
    assert list((tmp_path / "s2s").glob("*.safetensors")) and not list((tmp_path / "s2s").glob("*.bin"))
    loaded = Qwen3ForSeq2SeqLM.from_pretrained(tmp_path / "s2s", use_safetensors=True, trust_remote_code=False).eval()
    assert loaded.config.encoder_key_rope == "none" and loaded.config.is_encoder_decoder
    assert loaded.lm_head.weight is loaded.encoder.embed_tokens.weight is loaded.decoder.embed_tokens.weight
    enc, dec = random_ids(2, 7, vocab=V, seed=12), random_ids(2, 5, vocab=V, seed=13)
    torch.testing.assert_close(logits(loaded, enc, dec), logits(model, enc, dec))


def test_resize_token_embeddings_keeps_ties(model):
    enc, dec = random_ids(2, 7, vocab=V, seed=12), random_ids(2, 5, vocab=V, seed=13)
    before = logits(model, enc, dec)
    model.resize_token_embeddings(V + 8)
    assert model.lm_head.weight is model.encoder.embed_tokens.weight is model.decoder.embed_tokens.weight
    assert model.lm_head.weight.shape[0] == model.config.vocab_size == model.encoder.config.vocab_size == V + 8
    after = logits(model, torch.cat([enc, torch.full((2, 1), V + 7)], 1), dec,
                   enc_mask=torch.cat([torch.ones(2, 7), torch.zeros(2, 1)], 1).long())
    torch.testing.assert_close(after[..., :V], before, atol=1e-5, rtol=1e-5)  # old tokens' logits unchanged
    assert after.shape[-1] == V + 8


def test_config_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="encoder_key_rope must be one of"):
        Qwen3EncoderDecoderConfig(encoder_key_rope="alibi")
    with pytest.raises(ValueError, match="use_sliding_window=False"):
        Qwen3EncoderDecoderConfig(use_sliding_window=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Qwen3ForSeq2SeqLM.from_qwen3(tmp_path / "missing")
    config = Qwen3EncoderDecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        Qwen3ForSeq2SeqLM(config)(input_ids=torch.zeros(1, 3, dtype=torch.long),
                                  labels=torch.zeros(1, 2, dtype=torch.long))


# --------------------------------------------------------------------------------------------- the encoder
def test_extracted_encoder_equals_the_models_encoder(model, tmp_path):
    encoder = Qwen3EncoderModel.from_seq2seq(model).eval()
    enc, mask = random_ids(2, 9, vocab=V, seed=14), torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    with torch.no_grad():
        want = model(input_ids=enc, attention_mask=mask, decoder_input_ids=torch.full((2, 1), START))
        got = encoder(input_ids=enc, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want.encoder_last_hidden_state)
    assert got.data_ptr() != 0 and encoder.embed_tokens.weight is not model.encoder.embed_tokens.weight
    encoder.save_pretrained(tmp_path / "encoder")
    reloaded = load_encoder(tmp_path / "encoder")  # a plain Qwen3 checkpoint: loads wherever a Qwen3Model does
    assert type(reloaded).__name__ == "Qwen3Model"


def test_extracted_encoder_serves_as_awareness_memory_encoder(model, tmp_path, checkpoint_root):
    """The pair option `encoder_checkpoint=` swaps the pair's encoder for the extracted one, read bidirectionally."""
    Qwen3EncoderModel.from_seq2seq(model).save_pretrained(tmp_path / "ul2-encoder")
    torch.manual_seed(0)
    aware = build_pair("tiny", checkpoint_root=checkpoint_root, encoder_checkpoint=tmp_path / "ul2-encoder").eval()
    assert isinstance(aware, AwarenessModel) and aware.memory_encoder.attention == "bidirectional"
    memory = random_ids(1, 2, 8, vocab=V, seed=15)
    with torch.no_grad():
        states, _ = aware.memory_encoder(memory)
        want = model.encoder(input_ids=memory[0]).last_hidden_state.reshape(1, 16, -1)
        out = aware(input_ids=random_ids(1, 6, vocab=V, seed=16), memory_input_ids=memory)
    torch.testing.assert_close(states, want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out.logits).all()
