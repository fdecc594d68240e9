"""Tokens/s and MFU of a pair's training step on one GPU, against the same model's decoder alone.

    python benchmarks/gpu_mfu.py        # proto1 on CUDA, bf16, micro-batch found by doubling, H100 SXM peak
    python benchmarks/gpu_mfu.py --pair scale --levers eager liger compile both --profile proto1-step.txt
    python benchmarks/gpu_mfu.py --pair prod --layers 8   # the 30B-A3B pair's real shapes, 8 of its 48 layers
    python benchmarks/gpu_mfu.py --micro-batch 8 --gradient-checkpointing --peak-tflops 756   # e.g. an H100 PCIe
    python benchmarks/gpu_mfu.py --device cpu --pair tiny --peak-tflops 0.2 --seq 256 --chunks 4 --chunk-len 64 \\
        --micro-batch 2 --repeats 3                                                                   # a CPU smoke

Levers, one table row each, every row from the same process and card: `eager` (transformers' modules as they are),
`liger` (Liger-Kernel's fused RMSNorm, SwiGLU and RoPE: models/kernels.py), `compile` (regional torch.compile of
the layers: AwarenessModel.compile_layers) and `both`. The loss never holds full logits (models/loss.py; fused by
Liger where it is installed, whatever the lever). Liger patches transformers' classes for the rest of the process,
so its rows run after the others; each lever builds its model afresh and frees it before the next.

The step is the pipeline's training configuration (`pipelines.train.model.prepare_model` with ModelConfig's defaults:
decoder LoRA rank 16 on every projection, GCA blocks and memory projection trained in full, encoder frozen),
forward + backward + gradient clipping + torch AdamW (fused on CUDA), on random weights of the pair's real
architecture built directly on the device in the chosen dtype (`build_pair(random_init=True)`, no checkpoint I/O;
gates opened to 0.5). One process without DeepSpeed: ZeRO-3 on a single GPU would only add gathers. Parameters
and AdamW states are bf16 here, where DeepSpeed keeps fp32 master copies of the (small) trainable set.

MFU = model FLOPs per step / step time / peak FLOP/s, the FLOPs from `models.flops.training_flops`: matmuls only,
causal attention counted over the pairs the mask keeps, backward only where gradients flow (input gradients
through the decoder and GCA, weight gradients for LoRA and GCA only, the frozen encoder forward only), gradient-
checkpointing recomputation excluded. "6NT MFU" uses the common 6·N·T approximation instead (every weight
trained, attention free), for comparison. Before timing, one step of each kind runs under FlopCounterMode
(`models.flops.flop_counter`) as a check of the analytic count on the real shapes and kernels.
"""

from __future__ import annotations

import argparse
import gc
from typing import Callable

import torch
from timing import timed_side_by_side

from models import build_pair, training_flops
from models.flops import PARTS, flop_counter
from models.kernels import liger_available, use_liger_kernels
from pipelines.train.configs.stage import ModelConfig
from pipelines.train.model import prepare_model
from pipelines.train.profiling import activities, sort_key, top_operators

H100_SXM_BF16_DENSE_TFLOPS = 989.0  # H200 too; H100 PCIe: 756; A100: 312


LEVERS = ("eager", "compile", "liger", "both")  # the order they run in: Liger's patches cannot be undone


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, lever: str = "eager"):
    if lever in ("liger", "both") and not use_liger_kernels():
        raise SystemExit(f"lever {lever} needs Liger-Kernel on a CUDA device (the CUDA lock installs it)")
    torch.manual_seed(0)
    model = build_pair(args.pair, device=device, dtype=dtype, random_init=True, gca_layers=args.gca_layers,
                       layers=args.layers)
    model.to(device)  # a no-op: the weights are created on the device (this only guards that)
    config = ModelConfig(pair=args.pair, gca_layers=args.gca_layers, lora_rank=args.lora_rank,
                         gradient_checkpointing=args.gradient_checkpointing)
    prepare_model(model, config).train()
    with torch.no_grad():
        for block in model.gca_blocks().values():
            block.gate.fill_(0.5)  # an open gate, as after some training
    if lever in ("compile", "both"):
        model.compile_layers()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    return model, params, optimizer


def make_batches(model, micro_batch: int, args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """(with memory, decoder alone): random ids, every position real."""
    vocab, memory_vocab = model.decoder.config.vocab_size, model.memory_encoder.encoder.config.vocab_size
    ids = torch.randint(0, vocab, (micro_batch, args.seq), device=device)
    memory = torch.randint(0, memory_vocab, (micro_batch, args.chunks, args.chunk_len), device=device)
    return {"input_ids": ids, "memory_input_ids": memory}, {"input_ids": ids}


def make_step(model, params, optimizer, batch: dict) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(**batch, labels=batch["input_ids"]).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    return step


def largest_fitting_micro_batch(model, params, optimizer, args, device) -> int:
    """Doubles the micro-batch while a step with memory fits in GPU memory."""
    fitting, micro_batch = 0, 1
    while micro_batch <= args.max_micro_batch:
        try:
            step = make_step(model, params, optimizer, make_batches(model, micro_batch, args, device)[0])
            step()
            step()
            torch.cuda.synchronize()
            fitting = micro_batch
        except torch.cuda.OutOfMemoryError:
            break
        finally:
            step = None
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
        micro_batch *= 2
    if not fitting:
        raise SystemExit("a micro-batch of 1 does not fit: shorten --seq or the memory, "
                         "or pass --gradient-checkpointing")
    return fitting


def cross_check(model, batch: dict) -> tuple[float, float]:
    """FlopCounterMode's count of one forward + backward, and the analytic count in its convention (dense), plus
    the LM head's forward once more where the chunked loss recomputes it in backward (models/loss.py; Liger's fused
    loss computes its gradients in the forward instead)."""
    with flop_counter() as counter:
        model(**batch, labels=batch["input_ids"]).loss.backward()
    model.zero_grad(set_to_none=True)
    flops = training_flops(model, batch, causal="full")
    recomputed = 0.0 if liger_available() else flops.forward["lm_head"]
    return float(counter.get_total_flops()), flops.total + recomputed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="proto1", help="a name from models.PAIRS (MoE: FLOPs of the active experts)")
    parser.add_argument("--layers", type=int, default=None,
                        help="only the first N decoder and encoder layers of the real shapes (prod on one GPU)")
    parser.add_argument("--levers", nargs="+", choices=LEVERS, default=None,
                        help="rows to measure (default: all four on CUDA, eager on CPU)")
    parser.add_argument("--profile", default=None, help="write the top operators of one step of the first lever here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--seq", type=int, default=2048, help="decoder tokens per row")
    parser.add_argument("--chunks", type=int, default=16, help="memory chunks per row")
    parser.add_argument("--chunk-len", type=int, default=512, help="tokens per memory chunk")
    parser.add_argument("--micro-batch", default="auto",
                        help="rows per step, or 'auto': the largest power of two that fits (CUDA; 1 on CPU)")
    parser.add_argument("--max-micro-batch", type=int, default=64, help="where 'auto' stops doubling")
    parser.add_argument("--packed", type=int, default=1,
                        help="with N > 1, also time each lever's pair step on the same ids packed N examples a row "
                             "(segment ids: the masked attention a packed corpus row takes)")
    parser.add_argument("--gca-layers", default="upper_third", help="GCA placement (models.placement)")
    parser.add_argument("--lora-rank", type=int, default=16, help="decoder LoRA rank")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=H100_SXM_BF16_DENSE_TFLOPS,
                        help="the device's peak in TFLOP/s for the dtype (default: H100 SXM, bf16, dense)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps of each kind (medians reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each kind first")
    parser.add_argument("--no-flop-check", action="store_true", help="skip the FlopCounterMode cross-check")
    args = parser.parse_args()
    args.levers = args.levers or (list(LEVERS) if args.device.startswith("cuda") else ["eager"])

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cuda = device.type == "cuda"
    levers = sorted(args.levers, key=LEVERS.index)
    rows, micro_batch = [], None
    for lever in levers:
        model, params, optimizer = build(args, device, dtype, lever)
        if micro_batch is None:
            micro_batch = (largest_fitting_micro_batch(model, params, optimizer, args, device) if cuda else 1) \
                if args.micro_batch == "auto" else int(args.micro_batch)
            header(args, model, params, dtype, device, micro_batch)
        measured = measure(args, lever, model, params, optimizer, micro_batch, device, first=not rows)
        for row in measured:  # as it comes: a lever that hangs or runs out of time leaves the rows before it
            print(f"measured: {row['name']}: {row['time']:.4g} s/step, {micro_batch * args.seq / row['time']:,.0f} "
                  f"decoder tok/s, MFU {row['flops'].total / row['time'] / 1e12 / args.peak_tflops:.1%}", flush=True)
        rows += measured
        del model, params, optimizer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    table(args, rows, micro_batch)


def header(args, model, params, dtype, device, micro_batch: int) -> None:
    cuda = device.type == "cuda"
    trainable = sum(p.numel() for p in params)
    device_name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    layers, decoder = model.gca_layers, model.decoder.config
    shape = f"{decoder.num_hidden_layers} decoder layers" + (" (truncated: --layers)" if args.layers else "")
    print(f"torch {torch.__version__}, {device_name}, {str(dtype).removeprefix('torch.')}")
    print(f"pair {args.pair}, {shape}: GCA in decoder layers {layers[0]}-{layers[-1]} ({len(layers)}), decoder LoRA "
          f"rank {args.lora_rank}, GCA + projection trained in full, encoder frozen; {trainable / 1e6:.1f}M trainable; "
          f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    print(f"micro-batch {micro_batch} x {args.seq} decoder tokens, memory {args.chunks} x {args.chunk_len} tokens per "
          f"row; medians of {args.repeats} steps (forward + backward + clip + AdamW), timed in turns")
    print(f"peak used for MFU: {args.peak_tflops:g} TFLOP/s (--peak-tflops)")


def measure(args, lever: str, model, params, optimizer, micro_batch: int, device, first: bool) -> list[dict]:
    """The lever's pair step (and, for the first lever, the decoder alone) timed side by side: one row each."""
    cuda = device.type == "cuda"
    with_memory, alone = make_batches(model, micro_batch, args, device)
    batches = [with_memory, alone] if first else [with_memory]
    if args.packed > 1:
        batches.append(packed(with_memory, args.packed))
    steps = [make_step(model, params, optimizer, batch) for batch in batches]
    flops = [training_flops(model, batch) for batch in batches]
    checks = [] if args.no_flop_check or not first else [cross_check(model, batch) for batch in batches]
    for _ in range(args.warmup):
        for step in steps:
            step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = timed_side_by_side(steps, args.repeats, synchronize=torch.cuda.synchronize if cuda else None)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    if first and args.profile:
        profile_step(steps[0], args.profile, cuda)
    memory_tokens = micro_batch * args.chunks * args.chunk_len
    rows = [(f"pair, {lever}", memory_tokens)] + ([("decoder alone (no GCA, no memory), eager", 0)] if first else [])
    rows += [(f"pair, {lever}, {args.packed} examples packed a row", memory_tokens)] if args.packed > 1 else []
    checks = checks + [None] * (len(rows) - len(checks))
    return [{"name": name, "time": t, "flops": f, "memory_tokens": m, "peak": peak, "check": c}
            for (name, m), t, f, c in zip(rows, times, flops, checks, strict=True)]


def packed(batch: dict, examples: int) -> dict:
    """The same ids as `examples` examples a row, each with its own share of the chunks: segment ids, positions
    restarting per example (pipelines.data.packing's layout). The FLOPs are counted as for the plain rows, so the
    row beside them shows what the masks cost."""
    ids, memory = batch["input_ids"], batch["memory_input_ids"]
    (rows, seq), chunks = ids.shape, memory.shape[1]
    if seq % examples or chunks % examples:
        raise SystemExit(f"--packed {examples}: --seq ({seq}) and --chunks ({chunks}) must divide by it")
    device = ids.device
    per_token = torch.arange(examples, device=device).repeat_interleave(seq // examples)
    per_chunk = torch.arange(examples, device=device).repeat_interleave(chunks // examples)
    return {"input_ids": ids, "memory_input_ids": memory, "segment_ids": per_token.repeat(rows, 1),
            "position_ids": torch.arange(seq // examples, device=device).repeat(rows, examples),
            "memory_segment_ids": per_chunk.repeat(rows, 1)}


def profile_step(step: Callable[[], None], path: str, cuda: bool) -> None:
    """One step under torch.profiler: the top operators by device time (CPU time on CPU), written to `path`."""
    with torch.profiler.profile(activities=activities(cuda)) as profiler:
        step()
        if cuda:
            torch.cuda.synchronize()
    with open(path, "w") as f:
        f.write(top_operators(profiler, cuda))
    print(f"profile of one step, top operators by {sort_key(cuda)}: {path}")


def table(args, rows: list[dict], micro_batch: int) -> None:
    decoder_tokens = micro_batch * args.seq
    print(f"\n| {'step':<56} | {'s/step':>8} | {'decoder tok/s':>13} | {'memory tok/s':>12} | {'TFLOP/step':>10} "
          f"| {'TFLOP/s':>8} | {'MFU':>6} | {'6NT MFU':>7} | {'peak GiB':>8} | {'vs eager':>8} |")
    print(f"|{'-' * 58}|{'-' * 10}|{'-' * 15}|{'-' * 14}|{'-' * 12}"
          f"|{'-' * 10}|{'-' * 8}|{'-' * 9}|{'-' * 10}|{'-' * 10}|")
    first = rows[0]["time"]
    for row in rows:
        t, f = row["time"], row["flops"]
        achieved = f.total / t / 1e12
        peak = f"{row['peak']:8.1f}" if row["peak"] is not None else f"{'-':>8}"
        print(f"| {row['name']:<56} | {t:8.4g} | {decoder_tokens / t:13,.0f} | {row['memory_tokens'] / t:12,.0f} "
              f"| {f.total / 1e12:10.4g} | {achieved:8.4g} | {achieved / args.peak_tflops:6.1%} "
              f"| {f.approx_6nt / t / 1e12 / args.peak_tflops:7.1%} | {peak} | {first / t:8.2f} |")
    f = rows[0]["flops"]
    print("\nModel FLOPs of the pair's step by part (GFLOP, forward / backward): " + ", ".join(
        f"{part} {f.forward[part] / 1e9:.4g} / {f.backward[part] / 1e9:.4g}" for part in PARTS))
    for row in rows:
        if row["check"] is None:
            continue
        counted, analytic = row["check"]
        note = (" (counted includes checkpointing's recomputed forward, and the first layer's input gradients"
                " transformers' checkpointed layers take)") if args.gradient_checkpointing else ""
        print(f"FlopCounterMode, {row['name']}: {counted / 1e9:.6g} GFLOP counted vs {analytic / 1e9:.6g} analytic "
              f"with dense attention, ratio {counted / analytic:.4f}{note}")

if __name__ == "__main__":
    main()
