"""The Ray Train worker loop: DeepSpeed (ZeRO-3 by default) over the AwarenessModel, resumable and fault-tolerant.

`train_loop_per_worker` reads as a table of contents; each helper below it does one thing.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import deepspeed
import ray.train
import torch
import torch.distributed as dist

from models import AwarenessModel
from pipelines.evaluate import plots
from pipelines.evaluate.corpus import evaluate_corpus
from pipelines.evaluate.needle import evaluate_needles, needle_heatmap
from pipelines.tracking.tracker import Tracker
from pipelines.train.config import StageConfig
from pipelines.train.engine import (export_artifact, quiet_known_warnings, restore_checkpoint, save_checkpoint,
                                    setup_deepspeed)
from pipelines.train.model import build_model
from pipelines.train.streams import make_stream, packing_spec


@dataclass
class TrainState:
    """What a checkpoint carries besides the engine's shards: where the data stream stands and what was seen."""

    step: int = 0
    examples_seen: int = 0  # memories consumed by all workers
    index_checksum: int = 0  # sum of the example indices consumed: a skipped or repeated example changes it
    gate_history: list[list[float]] = field(default_factory=list)  # [step, |tanh(gate)| per GCA layer...]


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    config = StageConfig.from_dict(loop_config["config"])
    quiet_known_warnings()
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    torch.manual_seed(config.train.seed)
    model = build_model(config.model)
    engine = setup_deepspeed(model, config)
    state = restore_checkpoint(engine, TrainState)
    stream = make_stream(config, rank, world, state.step)
    tracker = Tracker(loop_config.get("tracking_uri"), loop_config.get("mlflow_run_id") if rank == 0 else None)
    faults = FaultInjector(loop_config.get("fail_at"), loop_config.get("fault_marker"), rank, world)
    step_seconds: list[float] = []
    heatmap: dict[str, Any] | None = None
    while state.step < config.train.max_steps:
        metrics = train_step(engine, config, state, stream)
        step_seconds.append(metrics["step_seconds"])
        metrics["step_seconds_median"] = statistics.median(step_seconds[-100:])
        faults.maybe_fail("train", state.step)
        final = state.step == config.train.max_steps
        logging_step = state.step % config.train.log_every == 0 or final
        if logging_step:
            metrics |= probe_metrics(engine, config, state, stream)
        if state.step % config.train.eval_every == 0 or final:
            metrics |= evaluate(engine.module, config, rank, world)
            logging_step = True
        if final and not config.data.train_path:
            heatmap = needle_heatmap(engine.module, config.needle.spec(), config.needle.seed + 1,
                                     config.needle.val_memories, rank, world)
        if logging_step:
            tracker.log_metrics(metrics, state.step)
        if state.step % config.train.checkpoint_every == 0 or final:
            save_checkpoint(engine, state, metrics, faults=faults,
                            export=functools.partial(export_artifact, engine, config) if final else None)
        elif logging_step:
            ray.train.report(metrics)
    finish_tracking(tracker, state, rank, engine.module.gca_layers, heatmap)
    tracker.save_pending(loop_config.get("tracking_pending"))  # the driver retries what the server refused



# ---------------------------------------------------------------------------------------------------- steps
def train_step(engine, config: StageConfig, state: TrainState, stream) -> dict[str, float]:
    started, losses, tokens, checksum, world = time.perf_counter(), [], 0, 0, dist.get_world_size()
    for micro in range(config.train.grad_accum):
        batch, _, batch_checksum = stream.batch(state.step, micro)
        out = engine(**{k: v.to(engine.device) for k, v in batch.items()})
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.detach())
        tokens += int((batch["labels"] != -100).sum()) if "segment_ids" in batch else batch["input_ids"].numel()
        checksum += batch_checksum
    totals = torch.tensor([torch.stack(losses).mean().item(), tokens, checksum], dtype=torch.float64)
    dist.all_reduce(totals)
    state.step += 1
    state.examples_seen += config.train.memories_per_step
    state.index_checksum += int(totals[2].item())  # global, so every rank's checkpointed state is the same
    return {
        "loss": totals[0].item() / world,
        "lr": engine.get_lr()[0],
        "tokens_per_s": totals[1].item() / (time.perf_counter() - started),
        "step_seconds": time.perf_counter() - started,
        "examples_seen": state.examples_seen,
        "index_checksum": float(state.index_checksum),
    }


def probe_metrics(engine, config: StageConfig, state: TrainState, stream) -> dict[str, float]:
    """Per-layer |tanh(gate)| and the attention entropy over the memory, on one training-shaped batch."""
    model: AwarenessModel = engine.module
    blocks = model.gca_blocks()
    with deepspeed.zero.GatheredParameters([b.gate for b in blocks.values()], enabled=config.deepspeed.zero_stage == 3):
        gates = {i: float(b.gate.detach().float().tanh().abs()) for i, b in blocks.items()}
    for b in blocks.values():
        b.probe_entropy = True
    with torch.no_grad():
        model(**{k: v.to(engine.device) for k, v in stream.probe_batch().items()})
    entropies = torch.tensor([float(b.last_entropy) for b in blocks.values()], dtype=torch.float64)
    for b in blocks.values():
        b.probe_entropy, b.last_entropy = False, None
    dist.all_reduce(entropies)
    entropies /= dist.get_world_size()
    state.gate_history.append([state.step, *gates.values()])
    metrics = {f"gate/layer_{i}": v for i, v in gates.items()}
    metrics |= {f"attention_entropy/layer_{i}": e for i, e in zip(blocks, entropies.tolist(), strict=True)}
    metrics["gate_abs_mean"] = sum(gates.values()) / len(gates)
    return metrics



def evaluate(model: AwarenessModel, config: StageConfig, rank: int, world: int) -> dict[str, float]:
    """Held-out needles, or the corpus' validation shard, with the memory and with it withheld."""
    if config.data.train_path:
        return evaluate_corpus(model, ray.train.get_dataset_shard("val"), packing_spec(config))
    return evaluate_needles(model, config.needle.spec(), config.needle.seed + 1, config.needle.val_memories, rank,
                            world)


def finish_tracking(tracker: Tracker, state: TrainState, rank: int, layers: list[int],
                    heatmap: dict[str, Any] | None = None) -> None:
    if rank != 0 or tracker.client is None or not state.gate_history:
        return
    if heatmap is not None:
        tracker.log_dict(heatmap, "needle_heatmap.json")
        figure = plots.needle_heatmap_figure(heatmap)
        tracker.log_figure(figure, "needle_heatmap.png")
        plots.close(figure)
    figure = plots.gate_figure(state.gate_history, layers)
    tracker.log_figure(figure, "gates.png")
    plots.close(figure)


class FaultInjector:
    """For fault-tolerance tests: `fail_at="train:STEP"` or `"save:STEP"` makes the last worker raise once there.
    A marker file makes it once per run, across the restarts Ray Train performs."""

    def __init__(self, fail_at: str | None, marker: str | None, rank: int, world: int):
        self.where, self.step = (fail_at.split(":")[0], int(fail_at.split(":")[1])) if fail_at else (None, -1)
        self.marker = Path(marker) if marker else None
        self.armed = fail_at is not None and rank == world - 1

    def maybe_fail(self, where: str, step: int) -> None:
        if not self.armed or where != self.where or step != self.step or self.marker is None or self.marker.exists():
            return
        self.marker.write_text(f"{where}:{step}")
        raise RuntimeError(f"injected failure at {where} step {step}")
