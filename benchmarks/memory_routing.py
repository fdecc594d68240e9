"""What chunk routing saves when the memory grows: per-token decoding time over 1k to 64k memory tokens with each
query reading its top-k chunks (`memory_top_k`, models/gca.py) against full attention over the whole memory.

    python benchmarks/memory_routing.py [--quick] [--top-k 4] [--chunk-len 128] [--tokens 1024 4096 16384 65536]
                                        [--threads N] [--chunk-weights router] [--lexical W] [--lexical-tokens]

`--chunk-weights router --lexical 1 --top-k 2` is the stage-0 preset's reading (router-mixed chunks, the question's
lexical prior; the memory's token ids random, the prompt naming some of them). `--lexical-tokens` adds the token
prior and the lexical gates (`memory_lexical_tokens`, `memory_lexical_gate`): each step looks its own token up.

One model, the tiny pair (random weights, fp32), built with routers; full attention is the same model with
memory_top_k set to 0, so both sides have the same weights. The memory is given as encoder states (as a memory store
gives it), chunked (1, C, L, H_enc); its keys, values and (routed) summary keys are prepared once, then each decoding
step is timed, full and routed in turns of a few steps each (benchmarks/timing.py), medians taken: in turns of one
step, the routed step ran after a full step had streamed the whole memory through the caches and measured that
eviction (1.98x at 64k where the same steps alone take 1.04-1.12x). A routed memory holds the prompt's lexical
prior from the prefill on, as `generate` holds it. Ratios are each side's time at N over
its own time at the smallest memory: full attention's grows with N, routing's with C (the summary scores) only.
"""

from __future__ import annotations

import argparse
import time

import torch

from models import MemoryReading, build_pair
from models.lexical import question_mask_of
from timing import timed_side_by_side


STEPS_A_TURN = 5  # timed decoding steps a side takes in a row (after one untimed: its caches, not the other's)


def build(top_k: int, fusion: str, gca_layers: str, chunk_weights: str = "attention", lexical: float = 0.0,
          lexical_tokens: bool = False, lexical_window: int = 1):
    torch.manual_seed(0)
    reading = MemoryReading(top_k=top_k, chunk_weights=chunk_weights, lexical_routing=lexical,
                            lexical_gate=lexical_tokens, lexical_tokens=lexical_tokens, lexical_window=lexical_window)
    model = build_pair("tiny", random_init=True, fusion=fusion, gca_layers=gca_layers, reading=reading).eval()
    if fusion == "gca":
        model.set_gates(0.5)  # an open gate: the block's output is used (its cost is the same either way)
    return model


class Decoder:
    """One side of the comparison: a prefilled prompt over a memory prepared with memory_top_k = top_k (the prepared
    memory carries the routing, so later steps need no setting), advanced one token per call."""

    def __init__(self, model, top_k: int, states: torch.Tensor, mask: torch.Tensor, prompt: torch.Tensor,
                 chunk_ids: torch.Tensor):
        self.model = model
        before = model.reading
        model.reading = before.with_top_k(top_k)
        try:
            started = time.perf_counter()
            self.memory = model.prepare_memory(memory_states=states, memory_states_mask=mask,
                                               memory_chunk_ids=chunk_ids if top_k else None)
            if top_k and model.reading.lexical_routing:  # the prompt's prior, once, as generate holds it
                self.memory = model.with_question(self.memory, prompt, question_mask_of(prompt, None, None))
            self.prepare_s = time.perf_counter() - started
            out = model(input_ids=prompt, gca_memory=self.memory, use_cache=True)
        finally:
            model.reading = before
        self.cache, self.token = out.cache, out.logits[:, -1:].argmax(-1)

    def step(self) -> None:
        out = self.model(input_ids=self.token, gca_memory=self.memory, cache=self.cache, use_cache=True)
        self.cache, self.token = out.cache, out.logits[:, -1:].argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1k and 4k tokens, fewer repeats (a smoke run)")
    parser.add_argument("--top-k", type=int, default=4, help="chunks each query reads when routed")
    parser.add_argument("--chunk-len", type=int, default=128, help="tokens per memory chunk")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536], help="memory sizes")
    parser.add_argument("--fusion", default="gca", choices=["gca", "cross"])
    parser.add_argument("--gca-layers", default="every_k:1", help="gca placement (default: all 4 layers read)")
    parser.add_argument("--repeats", type=int, default=30, help="decoding steps timed per side and size")
    parser.add_argument("--chunk-weights", default="attention", choices=["attention", "router"],
                        help="how the routed side mixes its chunks (models/gca.py)")
    parser.add_argument("--lexical", type=float, default=0.0, help="the routed side's memory_lexical_routing weight")
    parser.add_argument("--lexical-tokens", action="store_true",
                        help="with --lexical: the token prior and lexical gates too (memory_lexical_tokens)")
    parser.add_argument("--lexical-window", type=int, default=1,
                        help="with --lexical-tokens: the answer's window (memory_lexical_window)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); 1 is steadier "
                        "on a machine shared with other work")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes, repeats = ([1024, 4096], 5) if args.quick else (args.tokens, args.repeats)
    torch.set_grad_enabled(False)
    model = build(args.top_k, args.fusion, args.gca_layers, args.chunk_weights, args.lexical, args.lexical_tokens,
                  args.lexical_window)
    width = model.memory_encoder.hidden_size
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU; tiny pair, fusion {args.fusion}, "
          f"{len(model.gca_layers)} memory-reading layers, chunks of {args.chunk_len}, routed top-{args.top_k}, "
          f"chunk weights {args.chunk_weights}, lexical prior {args.lexical}"
          f"{', token prior' if args.lexical_tokens else ''}"
          f"{f', window {args.lexical_window}' if args.lexical_window > 1 else ''}")
    print(f"| {'memory tokens':>13} | {'chunks':>6} | {'full (ms)':>9} | {'routed (ms)':>11} | {'full t/t0':>9} | "
          f"{'routed t/t0':>11} | {'full / routed':>13} | {'prepare full / routed (ms)':>26} |")
    print("|" + "|".join("-" * (w + 2) for w in (13, 6, 9, 11, 9, 11, 13, 26)) + "|")
    first = None
    prompt = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    for tokens in sizes:
        chunks = max(tokens // args.chunk_len, 1)
        generator = torch.Generator().manual_seed(tokens)
        states = torch.randn(1, chunks, args.chunk_len, width, generator=generator)
        mask = torch.ones(1, chunks, args.chunk_len, dtype=torch.bool)
        chunk_ids = torch.randint(0, 496, (1, chunks, args.chunk_len), generator=generator)
        prompt[0, 1:4] = chunk_ids[0, chunks // 2, :3]  # the question names a chunk's tokens
        full, routed = (Decoder(model, k, states, mask, prompt, chunk_ids) for k in (0, args.top_k))
        t_full, t_routed = timed_side_by_side([full.step, routed.step], max(repeats // STEPS_A_TURN, 1),
                                              block=STEPS_A_TURN + 1)
        first = first or (t_full, t_routed)
        print(f"| {chunks * args.chunk_len:>13,} | {chunks:>6} | {t_full * 1e3:9.2f} | {t_routed * 1e3:11.2f} | "
              f"{t_full / first[0]:9.2f} | {t_routed / first[1]:11.2f} | {t_full / t_routed:13.2f} | "
              f"{f'{full.prepare_s * 1e3:.1f} / {routed.prepare_s * 1e3:.1f}':>26} |")


if __name__ == "__main__":
    main()
