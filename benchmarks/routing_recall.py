"""Did routing or reading fail? A routed gca export's needle answers beside its router's recall of the evidence.

Per needle task and memory size, on the evaluation's probes (pipelines.evaluate.needle: same generator, seed and
scoring): whole answers as the export reads, and with every chunk read (top-k = the memory's chunks); and per GCA
layer and kv head, at the question's last token (the query that predicts the first answer token), the share of
questions with an evidence chunk among

- the k chunks the router reads (`router`: its scores with the lexical priors, as the read chooses), and
- the k chunks full attention puts the most mass on (`attention`: what the routing loss teaches the router).

A question counts when one of its evidence chunks is there: its first read needs one (a chain reads the next at the
key its answer names). For a chain (two_hop, three_hop) the same two recalls at its second read too (`at the named
key`): the share of answers that name the chain's keys right, and at the last key its answer names, teacher-forced,
whether the chunk holding that key's value is read; and the same after each of the value's tokens but its last
(`in the value`: what the answer reads while it writes the value). Low `router` under high `attention` is a router
that did not learn what the block's own attention finds; both low, the block's queries do not match the evidence;
answers that rise with every chunk read put the loss on routing. rag's counterpart, BM25's recall:
benchmarks/rag_recall.py.

    python benchmarks/routing_recall.py --model EXPORT --variants alias two_hop --multipliers 1 4
    python benchmarks/routing_recall.py --model EXPORT --variants single --memories 2 --every_chunk false

The last line is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from pipelines.data.memory_modes import GCA, read_system
from pipelines.data.synthetic_needles import CHAIN_HOPS
from pipelines.evaluate.common import System, load_system
from pipelines.evaluate.needle import NeedleSuite, answer_probe, is_whole_answer, make_probe, system_prompts
from pipelines.evaluate.probes import chunk_reading
from pipelines.format.rows import IGNORE


def whole_answers(system: System, probes: list, named: bool = False) -> float:
    """The share of the probes' questions answered whole (the evaluation's `whole_answer`); `named`: instead, whose
    answer names its chain's keys right (the path, before the value)."""
    right = [answer[: len(path)] == path if named else is_whole_answer(answer, refs, path) for probe in probes
             for answer, refs, path in zip(answer_probe(system, probe), probe.references, probe.paths, strict=True)]
    return sum(right) / len(right)


def named_key_inputs(probe, value_tokens: int = 0) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """A chain probe's questions with the keys their answers name and the first `value_tokens` tokens of the value,
    teacher-forced (the labels mark that answer, so the lexical prior is the question's, as when the model
    generates), and per question the chunk holding the value the last named key binds (the fact its answer's value
    comes from)."""
    inputs = system_prompts(probe, GCA)
    answers = [path + refs[0][:value_tokens] for path, refs in zip(probe.paths, probe.references, strict=True)]
    inputs["input_ids"] = torch.tensor([q + a for q, a in zip(probe.questions, answers, strict=True)])
    inputs["labels"] = torch.tensor([[IGNORE] * len(q) + a for q, a in zip(probe.questions, answers, strict=True)])
    chunk_len = probe.memory.shape[1]
    return inputs, [[round(depth * probe.memory.size) // chunk_len] for depth in probe.depth]


def recalls(system: System, probes: list, k: int, named_key: bool = False,
            value_tokens: tuple[int, ...] = (0,)) -> dict[str, dict[str, float]]:
    """Per (GCA layer, kv head): the share of questions with an evidence chunk in the router's top k and in full
    attention's top k chunks by mass; `named_key`: at a chain's last named key, its value's chunk (and after each
    count of the value's tokens in `value_tokens`, 0 the key itself)."""
    hits: dict[str, dict[str, int]] = {"router": {}, "attention": {}}
    questions = 0
    layers = sorted(system.model.gca_blocks())
    for probe, written in ((p, n) for p in probes for n in (value_tokens if named_key else (0,))):
        inputs, evidence = (named_key_inputs(probe, written) if named_key else
                            (system_prompts(probe, system.mode), probe.evidence))
        reads = chunk_reading(system.model, **inputs)  # per layer (B, H_kv, C) x 2
        for layer, (scores, mass) in zip(layers, reads, strict=True):
            for name, values in (("router", scores), ("attention", mass)):
                top = values.topk(min(k, values.shape[-1]), dim=-1).indices  # (B, H_kv, k)
                for head in range(values.shape[1]):
                    found = sum(bool(set(top[q, head].tolist()) & set(chunks))
                                for q, chunks in enumerate(evidence))
                    key = f"layer{layer}/head{head}"
                    hits[name][key] = hits[name].get(key, 0) + found
        questions += len(probe.questions)
    return {name: {key: count / questions for key, count in by_head.items()} for name, by_head in hits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a routed gca export (a stage job's export/)")
    parser.add_argument("--variants", nargs="+", default=["alias", "two_hop"], help="needle tasks")
    parser.add_argument("--multipliers", nargs="+", type=int, default=[1, 4], help="memory sizes")
    parser.add_argument("--memories", type=int, default=16, help="probe memories per cell (8 questions each)")
    parser.add_argument("--seed", type=int, default=NeedleSuite().seed, help="the probes' seed (the suite's)")
    parser.add_argument("--every_chunk", choices=("true", "false"), default="true",
                        help="also answer with every chunk read")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    system = load_system("gca", args.model, read_system(args.model))
    reading = system.model.reading
    if system.mode.kind != "gca" or not reading.routes:
        parser.error(f"--model {args.model}: not a routed gca export (memory {system.mode.kind!r}, top_k "
                     f"{reading.top_k}); routing recall reads the router of a model built with memory_top_k > 0")
    summary = {"job": "routing_recall", "model": args.model, "top_k": reading.top_k, "cells": {}}
    print(f"| cell | whole | whole, every chunk read | router recall@{reading.top_k} by layer/head | "
          f"attention recall@{reading.top_k} by layer/head | keys named right; router / attention at the named key; "
          f"router / attention in the value |\n"
          f"|---|---|---|---|---|---|")
    for variant in args.variants:
        for multiplier in args.multipliers:
            probes = [make_probe(variant, system.spec, multiplier, args.seed, i) for i in range(args.memories)]
            cell = {"whole": whole_answers(system, probes), **recalls(system, probes, reading.top_k)}
            if variant in CHAIN_HOPS:
                second = recalls(system, probes, reading.top_k, named_key=True)
                digits = len(probes[0].references[0][0])
                in_value = recalls(system, probes, reading.top_k, named_key=True, value_tokens=tuple(range(1, digits)))
                cell |= {"router_at_named_key": second["router"], "attention_at_named_key": second["attention"],
                         "router_in_value": in_value["router"], "attention_in_value": in_value["attention"],
                         "keys_named_right": whole_answers(system, probes, named=True)}
            if args.every_chunk == "true":
                system.model.reading = replace(reading, top_k=int(probes[0].memory.shape[0]))
                cell["whole_every_chunk"] = whole_answers(system, probes)
                system.model.reading = reading
            summary["cells"][f"{variant}@{multiplier}x"] = cell
            every = f"{cell['whole_every_chunk']:.2f}" if "whole_every_chunk" in cell else "-"
            named = (f"{cell['keys_named_right']:.2f}; " + "; ".join(" / ".join(
                " ".join(f"{v:.2f}" for v in cell[f"{side}_{where}"].values()) for side in ("router", "attention"))
                for where in ("at_named_key", "in_value")) if variant in CHAIN_HOPS else "-")
            print(f"| {variant} {multiplier}x | {cell['whole']:.2f} | {every} | "
                  f"{' '.join(f'{v:.2f}' for v in cell['router'].values())} | "
                  f"{' '.join(f'{v:.2f}' for v in cell['attention'].values())} | "
                  f"{named} |", flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
