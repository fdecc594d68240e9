"""Tokens/s and MFU of a pair's training step on one GPU, against the same model's decoder alone.

    python benchmarks/gpu_mfu.py        # proto1 on CUDA, bf16, micro-batch found by doubling, H100 SXM peak
    python benchmarks/gpu_mfu.py --micro-batch 8 --gradient-checkpointing --peak-tflops 756   # e.g. an H100 PCIe
    python benchmarks/gpu_mfu.py --device cpu --pair tiny --peak-tflops 0.2 --seq 256 --chunks 4 --chunk-len 64 \\
        --micro-batch 2 --repeats 3                                                                   # a CPU smoke

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
from pipelines.train.configs.stage import ModelConfig
from pipelines.train.model import prepare_model

H100_SXM_BF16_DENSE_TFLOPS = 989.0  # H200 too; H100 PCIe: 756; A100: 312


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    torch.manual_seed(0)
    model = build_pair(args.pair, device=device, dtype=dtype, random_init=True, gca_layers=args.gca_layers)
    model.to(device)  # a no-op: the weights are created on the device (this only guards that)
    config = ModelConfig(pair=args.pair, gca_layers=args.gca_layers, lora_rank=args.lora_rank,
                         gradient_checkpointing=args.gradient_checkpointing)
    prepare_model(model, config).train()
    with torch.no_grad():
        for block in model.gca_blocks().values():
            block.gate.fill_(0.5)  # an open gate, as after some training
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
        raise SystemExit("a micro-batch of 1 does not fit: shorten --seq or the memory, or pass --gradient-checkpointing")
    return fitting


def cross_check(model, batch: dict) -> tuple[float, float]:
    """FlopCounterMode's count of one forward + backward, and the analytic count in its convention (dense)."""
    with flop_counter() as counter:
        model(**batch, labels=batch["input_ids"]).loss.backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops()), training_flops(model, batch, causal="full").total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="proto1", help="a name from models.PAIRS (dense decoders)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--seq", type=int, default=2048, help="decoder tokens per row")
    parser.add_argument("--chunks", type=int, default=16, help="memory chunks per row")
    parser.add_argument("--chunk-len", type=int, default=512, help="tokens per memory chunk")
    parser.add_argument("--micro-batch", default="auto",
                        help="rows per step, or 'auto': the largest power of two that fits (CUDA; 1 on CPU)")
    parser.add_argument("--max-micro-batch", type=int, default=64, help="where 'auto' stops doubling")
    parser.add_argument("--gca-layers", default="upper_third", help="GCA placement (models.placement)")
    parser.add_argument("--lora-rank", type=int, default=16, help="decoder LoRA rank")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=H100_SXM_BF16_DENSE_TFLOPS,
                        help="the device's peak in TFLOP/s for the dtype (default: H100 SXM, bf16, dense)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps of each kind (medians reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each kind first")
    parser.add_argument("--no-flop-check", action="store_true", help="skip the FlopCounterMode cross-check")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cuda = device.type == "cuda"
    model, params, optimizer = build(args, device, dtype)
    if args.micro_batch == "auto":
        micro_batch = largest_fitting_micro_batch(model, params, optimizer, args, device) if cuda else 1
    else:
        micro_batch = int(args.micro_batch)
    with_memory, alone = make_batches(model, micro_batch, args, device)
    steps = [make_step(model, params, optimizer, batch) for batch in (with_memory, alone)]
    flops = [training_flops(model, batch) for batch in (with_memory, alone)]
    checks = [] if args.no_flop_check else [cross_check(model, batch) for batch in (with_memory, alone)]
    for _ in range(args.warmup):
        for step in steps:
            step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = timed_side_by_side(steps, args.repeats, synchronize=torch.cuda.synchronize if cuda else None)

    trainable = sum(p.numel() for p in params)
    device_name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    layers = model.gca_layers
    print(f"torch {torch.__version__}, {device_name}, {str(dtype).removeprefix('torch.')}")
    print(f"pair {args.pair}: GCA in decoder layers {layers[0]}-{layers[-1]} ({len(layers)}), decoder LoRA rank "
          f"{args.lora_rank}, GCA + projection trained in full, encoder frozen; {trainable / 1e6:.1f}M trainable; "
          f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    print(f"micro-batch {micro_batch} x {args.seq} decoder tokens, memory {args.chunks} x {args.chunk_len} tokens per "
          f"row; medians of {args.repeats} steps (forward + backward + clip + AdamW), timed in turns")
    print(f"peak used for MFU: {args.peak_tflops:g} TFLOP/s (--peak-tflops)")
    if cuda:
        print(f"peak memory allocated: {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB of "
              f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.1f}")
    print()
    names = ["pair (decoder + GCA reading the memory + frozen encoder)", "decoder alone (no GCA, no memory)"]
    decoder_tokens, memory_tokens = micro_batch * args.seq, micro_batch * args.chunks * args.chunk_len
    print(f"| {'step':<56} | {'s/step':>8} | {'decoder tok/s':>13} | {'memory tok/s':>12} | {'TFLOP/step':>10} "
          f"| {'TFLOP/s':>8} | {'MFU':>6} | {'6NT MFU':>7} | {'time ratio':>10} |")
    print(f"|{'-' * 58}|{'-' * 10}|{'-' * 15}|{'-' * 14}|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 9}|{'-' * 12}|")
    for name, t, f, memory in zip(names, times, flops, (memory_tokens, 0)):
        achieved = f.total / t / 1e12
        print(f"| {name:<56} | {t:8.4g} | {decoder_tokens / t:13,.0f} | {memory / t:12,.0f} | {f.total / 1e12:10.4g} "
              f"| {achieved:8.4g} | {achieved / args.peak_tflops:6.1%} "
              f"| {f.approx_6nt / t / 1e12 / args.peak_tflops:7.1%} | {t / times[1]:10.2f} |")
    f = flops[0]
    print("\nModel FLOPs of the pair's step by part (GFLOP, forward / backward): " + ", ".join(
        f"{part} {f.forward[part] / 1e9:.4g} / {f.backward[part] / 1e9:.4g}" for part in PARTS))
    for name, (counted, analytic) in zip(("pair", "decoder alone"), checks):
        note = (" (counted includes checkpointing's recomputed forward, and the first layer's input gradients"
                " transformers' checkpointed layers take)") if args.gradient_checkpointing else ""
        print(f"FlopCounterMode, {name} step: {counted / 1e9:.6g} GFLOP counted vs {analytic / 1e9:.6g} analytic "
              f"with dense attention, ratio {counted / analytic:.4f}{note}")


if __name__ == "__main__":
    main()
