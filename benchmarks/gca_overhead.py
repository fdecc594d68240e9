"""What reading the memory costs: training-step time with and without GCA, and per-token decoding latency with a
cached memory against putting the same memory tokens in the decoder's prompt (the long-context baseline).

    python benchmarks/gca_overhead.py [--quick]

Everything is measured side by side in one run on random weights of one small config (8 layers, width 512).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from timing import timed_side_by_side
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from models import AwarenessModel, MemoryEncoder, set_trainable

DECODER = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, max_position_embeddings=32768, tie_word_embeddings=True)
ENCODER = dict(DECODER, num_hidden_layers=4, max_position_embeddings=4096)


def forward_flops(seq: int, memory: int, gca_layers: int) -> float:
    """Matmul FLOPs of one forward pass (training costs ~3x for decoder and GCA alike, so ratios carry over)."""
    d, hd, h, kv, ff, v, n = 512, 64, 8, 4, 1536, 8192, 8
    projections = 2 * seq * d * (2 * h * hd + 2 * kv * hd) + 2 * seq * 3 * d * ff
    decoder_layer = projections + 2 * 2 * seq * seq * h * hd
    gca_layer = 2 * seq * d * 2 * h * hd + 2 * memory * d * 2 * kv * hd + 2 * 2 * seq * memory * h * hd
    return n * decoder_layer + 2 * seq * d * v + gca_layers * gca_layer


def build(gca: bool, placement: str = "upper_third") -> tuple[Qwen3ForCausalLM, AwarenessModel | None]:
    torch.manual_seed(0)
    decoder = Qwen3ForCausalLM(Qwen3Config(**DECODER, attn_implementation="sdpa"))
    if not gca:
        return decoder, None
    encoder = Qwen3Model(Qwen3Config(**ENCODER, attn_implementation="sdpa"))
    model = AwarenessModel(decoder, MemoryEncoder(encoder), placement)
    with torch.no_grad():
        for block in model.gca_blocks().values():
            block.gate.fill_(0.5)  # an open gate, so the block's backward is not short-circuited
    return decoder, model


def training_step(seq: int, memory: int, chunk: int, repeats: int) -> list[tuple[str, float]]:
    """Forward + backward, decoder trained in full in both; the frozen encoder's pass is reported separately."""
    ids = torch.randint(0, 8192, (1, seq))
    mem = torch.randint(0, 8192, (1, memory // chunk, chunk))
    base, _ = build(gca=False)
    base.train()

    def base_step():
        base.zero_grad(set_to_none=True)
        base(input_ids=ids, labels=ids).loss.backward()

    def gca_model(placement: str) -> AwarenessModel:
        _, model = build(gca=True, placement=placement)
        set_trainable(model, decoder="full", gca="full")
        return model.train()

    upper, single = gca_model("upper_third"), gca_model("last:1")
    with torch.no_grad():
        states, mask = upper.encode_memory(mem)

    def gca_step(model: AwarenessModel):  # memory states from a store: only the GCA blocks' extra work
        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, memory_states=states, memory_states_mask=mask).loss.backward()
        return step

    def gca_step_with_encoder():  # the frozen encoder runs in the step too
        upper.zero_grad(set_to_none=True)
        upper(input_ids=ids, labels=ids, memory_input_ids=mem).loss.backward()

    times = timed_side_by_side([base_step, gca_step(upper), gca_step(single), gca_step_with_encoder], repeats)
    n_upper = len(upper.gca_layers)
    flops = [forward_flops(seq, memory, g) / forward_flops(seq, memory, 0) for g in (0, n_upper, 1)]
    return [
        ("base decoder", times[0], flops[0]),
        (f"+ GCA upper third (layers {upper.gca_layers[0]}-{upper.gca_layers[-1]}), memory states given", times[1],
         flops[1]),
        ("+ GCA in the last layer only, memory states given", times[2], flops[2]),
        ("+ GCA upper third, memory encoded in the step (frozen encoder)", times[3], None),
    ]


@torch.no_grad()
def decode_latency(memory: int, prompt: int, steps: int) -> tuple[float, float]:
    """Per-token latency after prefill: GCA with cached memory K/V vs the memory tokens in the prompt."""
    base, _ = build(gca=False)
    _, model = build(gca=True)
    base.eval(), model.eval()
    mem = torch.randint(0, 8192, (1, memory // 512, 512))
    ids = torch.randint(0, 8192, (1, prompt))
    long_ids = torch.cat([mem.reshape(1, -1), ids], dim=1)  # the long-context baseline's prompt

    def per_token(forward_prefill, forward_step) -> float:
        out = forward_prefill()
        cache, memory_kv, token = out.cache, getattr(out, "gca_memory", None), out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            out = forward_step(token, cache, memory_kv)
            times.append(time.perf_counter() - start)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        return statistics.median(times)

    t_gca = per_token(lambda: model(input_ids=ids, memory_input_ids=mem, use_cache=True),
                      lambda tok, cache, kv: model(input_ids=tok, gca_memory=kv, cache=cache, use_cache=True))
    t_long = per_token(lambda: base(input_ids=long_ids, use_cache=True),
                       lambda tok, cache, _: base(input_ids=tok, cache=cache, use_cache=True))
    return t_gca, t_long


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shorter sequences and fewer repeats (a smoke run)")
    args = parser.parse_args()
    seq, memory, repeats = (128, 512, 2) if args.quick else (512, 2048, 9)
    memories = (1024,) if args.quick else (1024, 4096, 16384)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU" if not torch.cuda.is_available()
          else f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"\nTraining step (forward + backward), 8 layers, width 512, sequence {seq}, memory {memory} tokens")
    rows = training_step(seq, memory, chunk=min(512, memory), repeats=repeats)
    base = rows[0][1]
    print(f"| {'variant':<66} | {'step (s)':>8} | {'ratio':>6} | {'FLOP ratio':>10} |")
    print(f"|{'-' * 68}|{'-' * 10}|{'-' * 8}|{'-' * 12}|")
    for name, t, flop_ratio in rows:
        flop = f"{flop_ratio:10.2f}" if flop_ratio else f"{'-':>10}"
        print(f"| {name:<66} | {t:8.3f} | {t / base:6.2f} | {flop} |")
    print("\nDecoding per token after prefill (prompt 32), memory cached vs the memory in the prompt")
    print(f"| {'memory tokens':>13} | {'GCA (ms)':>9} | {'long context (ms)':>17} | {'GCA / long':>10} |")
    print(f"|{'-' * 15}|{'-' * 11}|{'-' * 19}|{'-' * 12}|")
    for m in memories:
        t_gca, t_long = decode_latency(m, prompt=32, steps=8 if args.quick else 16)
        print(f"| {m:>13} | {t_gca * 1e3:9.2f} | {t_long * 1e3:17.2f} | {t_gca / t_long:10.2f} |")


if __name__ == "__main__":
    main()
