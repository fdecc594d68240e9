"""The stage-0 preset's training step on CPU, per memory size: the router-weighted read attending inside every chunk
against copying each query's k chunks out (models/gca.py; the same logits and gradients), and which one `auto`
takes, side by side.

    python benchmarks/routed_training.py [--quick] [--repeats 5] [--threads 1] [--max-scale 8]

One rank's micro-batch of the preset (8 memories, 8 questions each) from its mixture steps, one batch per memory
size (1x-8x the base: 4-32 chunks of 24 tokens; the preset trains on 1x-4x), forward and backward of the whole
model (encoder, decoder, routing loss) in one process; the steps of each size timed in turns (benchmarks/timing.py),
medians. The preset's model at its random initialisation: the cost of a step does not depend on what was learned.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from models.gca import ChunkRouting, _reads_gathered
from pipelines.data.streams import NeedleStream
from pipelines.train.model import build_model
from pipelines.train.presets import STAGE0
from pipelines.train.recipes import model_loss
from timing import timed_side_by_side

PATHS = ("masked", "gathered", "auto")  # masked: the router-weighted read attends every chunk


class Engine:
    """What model_loss needs of a DeepSpeed engine, for one process; its memory read on `path` (models/gca.py's
    ChunkRouting.path: how the chosen chunks are attended, the same result either way)."""

    def __init__(self, model):
        self.module, self.device, self.path = model, torch.device("cpu"), "auto"

    def __call__(self, **inputs):
        memory = self.module.prepare_memory(inputs.get("memory_input_ids"), inputs.get("memory_attention_mask"),
                                            segment_ids=inputs.get("segment_ids"),
                                            memory_segment_ids=inputs.get("memory_segment_ids"))
        for kv in memory.layers.values():
            kv.routing.path = self.path
        return self.module(gca_memory=memory, **inputs)


def batches_by_size(sizes: int, max_scale: int) -> dict[int, dict[str, torch.Tensor]]:
    """One micro-batch of rank 0 of 2 for each memory size mixture steps over 1x-max_scale memories draw, by chunk
    count."""
    spec = dataclasses.replace(STAGE0.needle.spec(), memory_scale_max=max_scale)
    stream = NeedleStream(spec, STAGE0.needle.seed, memories_per_step=STAGE0.train.memories_per_step, grad_accum=1,
                          rank=0, world=2, mode=STAGE0.model.memory_mode())
    found: dict[int, dict[str, torch.Tensor]] = {}
    step = spec.base_steps
    while len(found) < sizes:
        batch, _, _ = stream.batch(step, 0)
        found.setdefault(batch["memory_input_ids"].shape[1], batch)
        step += 1
    return dict(sorted(found.items()))


def auto_gathers(model, batch: dict[str, torch.Tensor]) -> bool:
    """What models/gca.py's rule picks for this batch's read: its queries (a memory's question tokens) over its
    chunks, on CPU."""
    memories, chunks = batch["memory_input_ids"].shape[:2]
    routing = ChunkRouting(summary=torch.zeros(1, 1, chunks, 1), chunk_len=1, top_k=model.reading.top_k,
                           chunk_mask=None, weights=model.reading.chunk_weights)
    return _reads_gathered(routing, batch["input_ids"].numel() // memories, torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the two smallest sizes, 2 repeats (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5, help="steps timed per path and size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a training worker has 1 here)")
    parser.add_argument("--max-scale", type=int, default=8, help="the largest memory, in base memories")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(STAGE0.model).train()
    engine = Engine(model)
    batches = batches_by_size(2 if args.quick else args.max_scale, args.max_scale)
    repeats = 2 if args.quick else args.repeats
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU; the stage-0 preset "
          f"(top-{model.reading.top_k} of chunks of {STAGE0.needle.spec().chunk_len}, router-weighted), forward and "
          f"backward of one rank's micro-batch")
    print("| chunks | every chunk (ms) | gathered (ms) | auto (ms) | every / gathered | auto reads |")
    print("|---|---|---|---|---|---|")
    for chunks, batch in batches.items():
        def step(path: str, batch=batch) -> None:
            engine.path = path
            model_loss(engine, batch).total.backward()
            model.zero_grad(set_to_none=True)

        every, gathered, auto = timed_side_by_side([lambda p=p: step(p) for p in PATHS], repeats)
        picked = "gathered" if auto_gathers(model, batch) else "every chunk"
        print(f"| {chunks} | {every * 1e3:.1f} | {gathered * 1e3:.1f} | {auto * 1e3:.1f} | {every / gathered:.2f} | "
              f"{picked} |")


if __name__ == "__main__":
    main()
