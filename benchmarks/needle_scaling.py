"""Needle accuracy against memory size, and the routers' recall of the evidence chunk, for a stage-0 model trained in
one process: quick experiments on training for size without Ray.

It trains with the project's own parts, as the stage-0 job's worker does: the preset's model config
(`pipelines.train.model.build_model`), the needle stream (`NeedleStream`), AdamW, gradient clipping and the job's
schedule (`pipelines.train.engine.Schedule`), plus the model's routing loss; then scores held-out memories with
`score_needles` (exact match, one question a row, as `jobs/evaluate.py` asks) at each size, and for a routing model
the share of questions whose evidence chunk is among the top-k chunks a router picks at the question's last token.
Phases train one after another on their own needle settings (a curriculum by hand); `--init-from` continues from a
saved model. Not a substitute for `jobs/stage0.py` + `jobs/evaluate.py`, which run the same model through Ray Train
and DeepSpeed: numbers from here are for comparing settings side by side.

python benchmarks/needle_scaling.py --model memory_top_k=4 --phase 6000: --save outputs/scaling/routed
python benchmarks/needle_scaling.py --init-from outputs/scaling/routed --model memory_top_k=4,memory_routing_grad=1 \
    --phase "1500:memory_scale_max=8,variants=single+multi_key" --lr 1e-3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from models.awareness import WEIGHTS_NAME
from pipelines.cli import from_typed_dict, to_dict
from pipelines.data.memory_modes import NO_MEMORY
from pipelines.data.streams import NeedleStream
from pipelines.data.synthetic_needles import generate_memory
from pipelines.evaluate.in_training import score_needles
from pipelines.evaluate.probes import chunk_reading
from pipelines.train.configs.stage import ModelConfig, NeedleConfig
from pipelines.train.engine import Schedule
from pipelines.train.model import build_model
from pipelines.train.presets import STAGE0

HELD_OUT_SEED = STAGE0.needle.seed + 1  # the stage job's validation memories
# phases start from the base task (single questions at the base size), not the preset's own curriculum
BASE_TASK = NeedleConfig(seed=STAGE0.needle.seed)


def overrides(text: str, base) -> dict:
    """`field=value,field=value` for a config dataclass, by its flags' names (`memory_top_k`): lists as a+b, booleans
    as 1/true."""
    out = {}
    defaults = to_dict(base)
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        current = defaults[name]
        if isinstance(current, list):
            out[name] = value.split("+")
        elif isinstance(current, bool):
            out[name] = value.lower() in ("1", "true")
        else:
            out[name] = type(current)(value)
    return out


def train(model, config: ModelConfig, phases: list[tuple[int, NeedleConfig]], lr: float, memories_per_step: int,
          log) -> None:
    t = dataclasses.replace(STAGE0.train, max_steps=sum(steps for steps, _ in phases), lr=lr)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule(t))
    model.train()
    step, start, losses, routing = 0, time.time(), [], []
    for steps, needle in phases:
        stream = NeedleStream(needle.spec(), needle.seed, memories_per_step=memories_per_step, grad_accum=1, rank=0,
                              world=1, mode=config.memory_mode())
        for _ in range(steps):
            out = model(**stream.batch(step, 0)[0])
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(out.loss.detach()))
            routing.append(float(out.routing_loss.detach()) if out.routing_loss is not None else 0.0)
            step += 1
            if step % 100 == 0 or step == t.max_steps:
                log(f"step {step}/{t.max_steps} loss {np.mean(losses[-100:]):.3f} routing_loss "
                    f"{np.mean(routing[-100:]):.4f} gates {[round(v, 2) for v in model.gate_values().values()]} "
                    f"{time.time() - start:.0f}s")


@torch.no_grad()
def evaluate(model, config: ModelConfig, variants: list[str], scales: list[int], memories: int) -> dict[str, float]:
    model.eval()
    spec, mode = BASE_TASK.spec(), config.memory_mode()
    result = {}
    for variant in variants:
        for scale in scales:
            scores = score_needles(model, spec, HELD_OUT_SEED, list(range(memories)), mode=mode, variant=variant,
                                   scale=scale, batch_memories=8)
            result[f"{variant}/{scale}x"] = round(scores.accuracy, 3)
    result["no_memory"] = round(score_needles(model, spec, HELD_OUT_SEED, list(range(memories)), mode=NO_MEMORY)
                                .accuracy, 3)
    return result


@torch.no_grad()
def router_recall(model, variant: str, scale: int, memories: int) -> dict[str, float]:
    """Per routing layer: the share of questions whose evidence chunk is among the top-k chunks the router picks (for
    either kv head) at the question's last prompt token, and beside it (`L/full`) among the top-k chunks by full
    attention's chunk mass for the same query: the routing loss's teacher, which the router can only imitate
    (pipelines.evaluate.probes.chunk_reading; benchmarks/routing_recall.py gives them per kv head for an export)."""
    model.eval()
    spec = BASE_TASK.spec()
    layers = sorted(model.gca_blocks())
    hits, total = {}, 0
    for index in range(memories):
        drawn = generate_memory(variant, spec, scale, np.random.default_rng([HELD_OUT_SEED, index]))
        questions = torch.tensor(drawn.questions)
        memory = torch.from_numpy(drawn.memory)[None].expand(len(questions), -1, -1)  # one memory row a question
        reads = chunk_reading(model, input_ids=questions, memory_input_ids=memory)
        for i, (scores, mass) in zip(layers, reads, strict=True):  # (B, H_kv, C) each
            k = min(model.reading.top_k, scores.shape[-1])
            chosen, teacher = scores.topk(k, dim=-1).indices, mass.mean(1).topk(k, dim=-1).indices
            for q, evidence in enumerate(drawn.evidence):
                hits[str(i)] = hits.get(str(i), 0) + bool(set(evidence) & set(chosen[q].flatten().tolist()))
                hits[f"{i}/full"] = hits.get(f"{i}/full", 0) + bool(set(evidence) & set(teacher[q].tolist()))
        total += len(drawn.questions)
    return {i: round(n / max(total, 1), 3) for i, n in hits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="ModelConfig overrides on the stage-0 preset, e.g. memory_top_k=4")
    parser.add_argument("--phase", action="append", default=[],
                        help="STEPS:needle overrides, e.g. 1500:memory_scale_max=8,variants=single+multi_key")
    parser.add_argument("--lr", type=float, default=STAGE0.train.lr)
    parser.add_argument("--memories-per-step", type=int, default=STAGE0.train.memories_per_step)
    parser.add_argument("--init-from", help="a directory this script (or AwarenessModel.save_pretrained) wrote")
    parser.add_argument("--save", help="write the trained model here")
    parser.add_argument("--variants", nargs="+", default=["single", "multi_key"])
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--memories", type=int, default=32, help="held-out memories a cell (8 questions each)")
    parser.add_argument("--recall", action="store_true", help="also each routing layer's recall of the evidence chunk")
    parser.add_argument("--read-top-k", type=int, help="score reading with this memory_top_k (0: full attention)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("THREADS", "1")))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = from_typed_dict(ModelConfig, to_dict(STAGE0.model) | overrides(args.model, ModelConfig()))
    model = build_model(config)
    if args.init_from:
        missing, unexpected = model.load_state_dict(load_file(str(Path(args.init_from) / WEIGHTS_NAME)), strict=False)
        if unexpected:
            raise SystemExit(f"--init-from {args.init_from}: weights this model does not have: {unexpected[:4]}")
    phases = []
    for phase in args.phase:
        steps, _, text = phase.partition(":")
        phases.append((int(steps), dataclasses.replace(BASE_TASK, **overrides(text, NeedleConfig()))))
    if phases:
        train(model, config, phases, args.lr, args.memories_per_step, lambda line: print(line, flush=True))
    if args.save:
        model.save_pretrained(args.save)
    if args.read_top_k is not None:
        model.reading = model.reading.with_top_k(args.read_top_k)
    summary = {"accuracy": evaluate(model, config, args.variants, args.scales, args.memories)}
    if args.recall and model.reading.top_k:
        summary["recall"] = {f"{v}/{s}x": router_recall(model, v, s, args.memories)
                             for v in args.variants for s in args.scales}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
