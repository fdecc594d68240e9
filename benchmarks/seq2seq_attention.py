"""What merged attention costs against a classic encoder-decoder, and what caching the encoder's keys/values saves.

    python benchmarks/seq2seq_attention.py [--quick]

1. Training step (forward + backward + AdamW) of Qwen3ForSeq2SeqLM with merged attention against the same model
   whose decoder layers instead hold a T5-style separate cross-attention block of the same width (its own norm and
   q/k/v/o projections, after the causal self-attention): time, activation memory saved for backward (and the CUDA
   peak when on a GPU), parameters.
2. Decoding per-token latency of the merged model with the encoder's keys/values projected once into the cache
   against re-projecting them at every step (what the seed draft did).
Everything is measured side by side in one run, on random weights of one config (8 layers, width 512).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from timing import timed_side_by_side
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

from models import Qwen3EncoderDecoderConfig, Qwen3ForSeq2SeqLM

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=32768, tie_word_embeddings=True,
              encoder_layers=4, decoder_start_token_id=0, pad_token_id=0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class SeparateCrossAttentionLayer(nn.Module):
    """The classic (T5-style) decoder layer: causal self-attention, then cross-attention with its own norm and
    projections, then the MLP. It accepts the merged decoder's call, so it runs in the same loop."""

    def __init__(self, config: Qwen3EncoderDecoderConfig, layer_idx: int):
        super().__init__()
        self.layer = Qwen3DecoderLayer(config, layer_idx)  # self-attention (causal, via the mask), MLP, norms
        self.cross_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        heads, kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=False)
        self.layer_idx = layer_idx

    def forward(self, hidden_states, attention_mask, position_embeddings, cache=None,
                encoder_hidden_states=None, **kwargs):
        b, t, _ = hidden_states.shape
        s = encoder_hidden_states.shape[1]
        self_mask, cross_mask = attention_mask[..., :-s], attention_mask[..., -s:]
        residual = hidden_states
        attn, _ = self.layer.self_attn(self.layer.input_layernorm(hidden_states), position_embeddings, self_mask,
                                       cache=cache.self_attention_cache if cache else None)
        hidden_states = residual + attn
        q = self.q_proj(self.cross_norm(hidden_states)).view(b, t, -1, self.head_dim).transpose(1, 2)
        if cache is not None and cache.is_updated.get(self.layer_idx):
            cached = cache.cross_attention_cache.layers[self.layer_idx]
            k, v = cached.keys, cached.values
        else:
            k = self.k_proj(encoder_hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
            v = self.v_proj(encoder_hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
            if cache is not None:
                k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        cross = F.scaled_dot_product_attention(q, k, v, attn_mask=cross_mask, enable_gqa=True)  # (B, nh, T, hd)
        hidden_states = hidden_states + self.o_proj(cross.transpose(1, 2).reshape(b, t, -1))
        return hidden_states + self.layer.mlp(self.layer.post_attention_layernorm(hidden_states))


def build(classic: bool) -> Qwen3ForSeq2SeqLM:
    torch.manual_seed(0)
    config = Qwen3EncoderDecoderConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    model = Qwen3ForSeq2SeqLM(config)
    if classic:
        model.decoder.layers = nn.ModuleList(SeparateCrossAttentionLayer(config, i)
                                             for i in range(config.num_hidden_layers))
    return model.to(DEVICE)


def saved_activation_bytes(model, batch) -> int:
    """Bytes of activations autograd keeps for backward in one forward (weights it saves are not counted: they are
    held anyway): what differs between the variants' training memory on a CPU, where there is no allocator peak."""
    total, weights = 0, {p.data_ptr() for p in model.parameters()}

    def pack(tensor):
        nonlocal total
        if tensor.data_ptr() not in weights:
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def training_step(batch_size: int, enc_len: int, dec_len: int, repeats: int) -> list[dict]:
    batch = {"input_ids": torch.randint(1, 8192, (batch_size, enc_len), device=DEVICE),
             "labels": torch.randint(1, 8192, (batch_size, dec_len), device=DEVICE)}
    rows, steps = [], []
    for classic in (False, True):
        model = build(classic).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            optimizer.step()

        peak = None
        if DEVICE == "cuda":
            step()
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = torch.cuda.max_memory_allocated()
        rows.append({"name": "separate cross-attention (T5-style)" if classic else "merged attention",
                     "params": sum(p.numel() for p in model.parameters()),
                     "saved": saved_activation_bytes(model, batch), "peak": peak})
        steps.append(step)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else None
    for row, seconds in zip(rows, timed_side_by_side(steps, repeats, sync)):
        row["seconds"] = seconds
    return rows


@torch.no_grad()
def decode_latency(enc_len: int, steps: int, batch_size: int = 1) -> tuple[float, float]:
    """Per-token latency after the first step: encoder K/V from the cache vs projected again at every step."""
    model = build(classic=False).eval()
    enc = model.encoder(input_ids=torch.randint(1, 8192, (batch_size, enc_len), device=DEVICE))

    def per_token(reproject: bool) -> float:
        token = torch.zeros(batch_size, 1, dtype=torch.long, device=DEVICE)
        out = model(encoder_outputs=enc, decoder_input_ids=token, use_cache=True)
        cache, times = out.cache, []
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            if reproject:  # the seed's way: the encoder's keys/values projected anew (not appended) each step
                cache.cross_attention_cache, cache.is_updated = DynamicCache(), {}
            start = time.perf_counter()
            out = model(encoder_outputs=enc, decoder_input_ids=token, cache=cache, use_cache=True)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    per_token(False)  # warm-up
    cached, reprojected = [], []
    for _ in range(3):  # alternate, so background load hits both alike
        cached.append(per_token(False))
        reprojected.append(per_token(True))
    return statistics.median(cached), statistics.median(reprojected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter sequences and fewer repeats (a smoke run)")
    args = parser.parse_args()
    batch, enc_len, dec_len, repeats = (2, 128, 64, 2) if args.quick else (4, 512, 256, 7)
    encoder_lengths = (512,) if args.quick else (512, 2048, 8192)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, fp32; decoder 8 layers, encoder 4 layers, width 512, GQA 8/4 heads")
    print(f"\nTraining step (forward + backward + AdamW), batch {batch}, encoder {enc_len} tokens, decoder {dec_len}")
    rows = training_step(batch, enc_len, dec_len, repeats)
    merged = rows[0]
    print(f"| {'decoder layers':<36} | {'params (M)':>10} | {'step (s)':>8} | {'time ratio':>10} | "
          f"{'saved activations (MiB)':>23} | {'ratio':>5} |" + (" CUDA peak (MiB) |" if merged["peak"] else ""))
    print(f"|{'-' * 38}|{'-' * 12}|{'-' * 10}|{'-' * 12}|{'-' * 25}|{'-' * 7}|"
          + ("-" * 18 + "|" if merged["peak"] else ""))
    for row in rows:
        peak = f" {row['peak'] / 2**20:15.0f} |" if row["peak"] else ""
        print(f"| {row['name']:<36} | {row['params'] / 1e6:10.2f} | {row['seconds']:8.3f} | "
              f"{row['seconds'] / merged['seconds']:10.2f} | {row['saved'] / 2**20:23.1f} | "
              f"{row['saved'] / merged['saved']:5.2f} |{peak}")
    print("\nDecoding per token (batch 1), merged attention: encoder K/V cached vs re-projected every step")
    print(f"| {'encoder tokens':>14} | {'cached (ms)':>11} | {'re-projected (ms)':>17} "
          f"| {'re-projected / cached':>21} |")
    print(f"|{'-' * 16}|{'-' * 13}|{'-' * 19}|{'-' * 23}|")
    for length in encoder_lengths:
        cached, reprojected = decode_latency(length, steps=8 if args.quick else 16)
        print(f"| {length:>14} | {cached * 1e3:11.2f} | {reprojected * 1e3:17.2f} | {reprojected / cached:21.2f} |")


if __name__ == "__main__":
    main()
