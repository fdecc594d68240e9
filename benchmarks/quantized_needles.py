"""The needle suite's answers from an export reloaded onto a base in fewer bits (as the Serve app's and the pyfunc's
`quantize` loads it: models.quantization) against the same export on its stored base: accuracy per cell, the share
of questions whose greedy answer changed, and how far the logits moved (each question's next-token logits after its
prompt: the largest absolute difference from the stored base's, and the share whose top token is the same).

    python benchmarks/quantized_needles.py --model EXPORT                     # nf4 and int8 against the stored base
    python benchmarks/quantized_needles.py --model EXPORT --quantize nf4 --variants single --multipliers 1 --memories 2
    python benchmarks/quantized_needles.py --model EXPORT --quantize nf4 --base_dtype bfloat16  # against a bf16 base

The probes are the evaluation's (pipelines.evaluate.needle: same generator, seed and scoring), answered in this
process one after another; on CPU the quantized linears compute in fp32 (models.quantization.compute_dtype), on a
GPU in bf16. The last line is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json

import torch

from models import AwarenessModel
from models.quantization import compute_dtype
from models.specs import QUANTIZE
from pipelines.data.memory_modes import read_system, system_mode
from pipelines.evaluate.common import System, needle_spec
from pipelines.evaluate.metrics import string_match_all
from pipelines.evaluate.needle import NeedleSuite, answer_probe, as_text, make_probe, system_prompts

TRAINED = ["single", "multi_key", "multi_value", "multi_query"]


def load(export: str, quantize: str, device: str, base_dtype: str = "stored") -> System:
    system = read_system(export)
    if quantize != "none":
        dtype = compute_dtype(device)
    else:
        dtype = None if base_dtype == "stored" else getattr(torch, base_dtype)
    model = AwarenessModel.from_pretrained(export, device=device, dtype=dtype, quantize=quantize).eval()
    return System(quantize, model, system_mode(system), needle_spec(system), export=export)


@torch.no_grad()
def next_token_logits(system: System, probe) -> torch.Tensor:
    """Each question's logits for the first answer token, in fp32 on the CPU."""
    inputs = {k: v.to(system.model.device) for k, v in system_prompts(probe, system.mode).items()}
    return system.model(**inputs).logits[:, -1].float().cpu()


def answer_cells(system: System, args: argparse.Namespace) -> dict[str, tuple[list[tuple[str, float]], torch.Tensor]]:
    """(variant@multiplier) -> one (answer text, RULER score) per question over every probe memory of the cell, and
    the questions' next-token logits."""
    cells = {}
    for variant in args.variants:
        for multiplier in args.multipliers:
            rows, logits = [], []
            for index in range(args.memories):
                probe = make_probe(variant, system.spec, multiplier, args.seed, index)
                logits.append(next_token_logits(system, probe))
                for answer, refs in zip(answer_probe(system, probe), probe.references, strict=True):
                    text = as_text(answer)
                    rows.append((text, string_match_all([text], [[as_text(ref) for ref in refs]])))
            cells[f"{variant}@{multiplier}x"] = rows, torch.cat(logits)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an export directory (a stage job's export/)")
    parser.add_argument("--quantize", nargs="+", choices=[q for q in QUANTIZE if q != "none"], default=["nf4", "int8"])
    parser.add_argument("--variants", nargs="+", default=TRAINED, help="needle tasks (the demo's trained four)")
    parser.add_argument("--multipliers", nargs="+", type=int, default=[1, 4, 16], help="memory sizes")
    parser.add_argument("--memories", type=int, default=16, help="probe memories per cell (8 questions each)")
    parser.add_argument("--seed", type=int, default=NeedleSuite().seed, help="the probes' seed (the suite's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--base_dtype", choices=["stored", "bfloat16"], default="stored",
                        help="the reference: the export on its base in the checkpoints' dtype, or in bf16")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {q: answer_cells(load(args.model, q, args.device, args.base_dtype), args)
               for q in ["none", *args.quantize]}
    reference = results["none"]
    base = "stored base" if args.base_dtype == "stored" else "bf16 base"
    print(f"| cell | {base} | {' | '.join(args.quantize)} | answers changed | logits max abs diff | "
          f"same top token |")
    print(f"|---|---|{'---|' * len(args.quantize)}---|---|---|")
    summary = {"job": "quantized_needles", "model": args.model, "device": args.device, "base_dtype": args.base_dtype,
               "cells": {}}
    for cell, (rows, logits) in reference.items():
        accuracy = {q: sum(s for _, s in results[q][cell][0]) / len(rows) for q in results}
        changed = {q: sum(a != b for (a, _), (b, _) in zip(results[q][cell][0], rows, strict=True)) / len(rows)
                   for q in args.quantize}
        moved = {q: (results[q][cell][1] - logits).abs().max().item() for q in args.quantize}
        same_top = {q: (results[q][cell][1].argmax(-1) == logits.argmax(-1)).float().mean().item()
                    for q in args.quantize}

        def by_quantize(values: dict[str, float], digits: int) -> str:
            return ", ".join(f"{values[q]:.{digits}f}" for q in args.quantize)

        print(f"| {cell} | {accuracy['none']:.3f} | {' | '.join(f'{accuracy[q]:.3f}' for q in args.quantize)} | "
              f"{by_quantize(changed, 3)} | {by_quantize(moved, 4)} | {by_quantize(same_top, 3)} |", flush=True)
        summary["cells"][cell] = {"accuracy": accuracy, "changed": changed, "logits_max_abs_diff": moved,
                                  "same_top_token": same_top}
    summary["max_accuracy_gap"] = {q: max(abs(c["accuracy"][q] - c["accuracy"]["none"])
                                          for c in summary["cells"].values()) for q in args.quantize}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
