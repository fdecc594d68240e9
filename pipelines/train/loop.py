"""The Ray Train worker loop every job runs: DeepSpeed (ZeRO-3 by default) over the recipe's model, resumable and
fault-tolerant. `train_loop_per_worker` reads as a table of contents; each helper below it does one thing."""

from __future__ import annotations

import functools
import importlib
import statistics
import time
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist

from pipelines.evaluate.collectives import summed_over_ranks
from pipelines.tracking.checkpoints import EXPORT_DIR, UNAVERAGED_EXPORT_DIR
from pipelines.tracking.tracker import Tracker, for_other_nodes
from pipelines.train.averaging import WeightAverage, applied
from pipelines.train.engine import (Schedule, deepspeed_config, quiet_known_warnings, restore_checkpoint,
                                    save_checkpoint, setup_deepspeed)
from pipelines.train.hooks import installed_hook
from pipelines.train.plan import measured_peak_gib
from pipelines.train.recipes import Recipe, TrainState


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    recipe = recipe_from(loop_config["recipe"])
    config, worker = recipe.parse(loop_config["config"]), loop_config["worker"]
    quiet_known_warnings()
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    torch.manual_seed(config.train.seed)
    ds_config = deepspeed_config(config, world)
    model = recipe.build_model(config, worker, ds_config)
    schedule = Schedule(config.train)  # the learning rate's; a recipe may move its cosine (TrainState.decay)
    engine = setup_deepspeed(model, config, recipe.parameter_groups(model), ds_config, schedule)
    average = WeightAverage.of_trained(engine.module, config.train.ema_decay)  # None: no averaging
    state = resumed_state(engine, world, average)
    stream = recipe.stream(config, worker, rank, world, state.step)
    tracker = Tracker(worker_tracking_uri(loop_config), loop_config.get("mlflow_run_id") if rank == 0 else None)
    hook, t, step_seconds = installed_hook(), config.train, []  # hook: pipelines.train.hooks, "train" and "save"
    while state.step < state.last_step(t.max_steps):
        decided = recipe.before_step(engine, config, state, stream)
        if decided:  # logged at the step it measured, whether or not the step is a logging one
            tracker.log_metrics(decided, state.step)
        schedule.span = state.decay
        metrics = train_step(engine, recipe, config, state, stream)
        if state.decay:
            metrics["last_step"] = state.decay[1]
        if average is not None:
            average.update()
        step_seconds.append(metrics["step_seconds"])
        metrics["step_seconds_median"] = statistics.median(step_seconds[-100:])
        hook("train", state.step)
        final = state.step == state.last_step(t.max_steps)
        logging_step = state.step % t.log_every == 0 or final
        if logging_step:
            metrics |= recipe.probe(engine, config, state, stream)
        if state.step % t.eval_every == 0 or final:
            with applied(average):  # what the export holds
                metrics |= recipe.evaluate(engine, config, rank, world)
            if average is not None and final:
                unaveraged = recipe.evaluate(engine, config, rank, world)
                metrics |= {f"unaveraged/{k}": v for k, v in unaveraged.items()}
            logging_step = True
        if logging_step:
            peak = measured_peak_gib()  # GPU workers: this rank's peak so far, as jobs/plan.py counts it
            metrics |= {"gpu_peak_gib": peak} if peak is not None else {}
            tracker.log_metrics(metrics, state.step)
        if state.step % t.checkpoint_every == 0 or final:
            # Every checkpoint carries the small export (GCA, projection, LoRA: gathered, not the base weights), so any
            # of them can be registered; run.export_every_checkpoint false keeps it to the final one.
            exported = final or config.run.export_every_checkpoint
            write = functools.partial(checkpoint_extras, recipe, engine, config, worker, average, exported, final)
            save_checkpoint(engine, state, metrics, write=write,
                            before_report=functools.partial(hook, "save", state.step))
        elif logging_step:
            ray.train.report(metrics)
    with applied(average):
        recipe.finish(engine, config, state, tracker, rank, world)
    tracker.save_pending(loop_config.get("tracking_pending"))  # the driver retries what the server refused


def checkpoint_extras(recipe: Recipe, engine, config, worker: dict[str, Any], average: WeightAverage | None,
                      exported: bool, final: bool, directory: Path) -> None:
    """What a checkpoint holds besides the engine's shards: the export (of the averaged weights where the run averages
    them), the average itself, and in the final one the last step's own weights exported beside it."""
    if exported:
        with applied(average):
            recipe.export(engine, config, worker, directory / EXPORT_DIR)
    if average is not None:
        if dist.get_rank() == 0:
            average.save(directory)
        if final:
            recipe.export(engine, config, worker, directory / UNAVERAGED_EXPORT_DIR)


def recipe_from(reference: str) -> Recipe:
    """The recipe a "module:Class" reference names (pipelines.train.driver.recipe_reference)."""
    module, name = reference.split(":")
    return getattr(importlib.import_module(module), name)()


def worker_tracking_uri(loop_config: dict[str, Any]) -> str | None:
    """The driver's tracking URI as this worker reaches it: a loopback server on the driver's node is that node's
    address from any other node (a server bound to loopback alone, e.g. a local test server, stays loopback here)."""
    uri, driver_ip = loop_config.get("tracking_uri"), loop_config.get("driver_ip")
    if uri is None or driver_ip is None or ray.util.get_node_ip_address() == driver_ip:
        return uri
    return for_other_nodes(uri, driver_ip)


def train_step(engine, recipe: Recipe, config, state: TrainState, stream) -> dict[str, float]:
    """One optimizer step over train.grad_accum micro-batches; loss (and the recipe's loss parts), tokens and the
    index checksum over all ranks."""
    started, losses, parts, tokens, checksum = time.perf_counter(), [], [], 0, 0
    t, world = config.train, dist.get_world_size()
    for micro in range(t.grad_accum):
        batch, _, batch_checksum = stream.batch(state.step, micro)
        loss = recipe.loss(engine, config, batch)
        engine.backward(loss.total)
        engine.step()
        losses.append(loss.total.detach())
        parts.append(loss.parts)
        tokens += recipe.count_tokens(batch)
        checksum += batch_checksum
    names = sorted(parts[0])  # the same parts on every rank and micro-batch
    means = [torch.stack([p[n].detach() for p in parts]).mean().item() for n in names]
    totals = torch.tensor([torch.stack(losses).mean().item(), tokens, checksum, *means], dtype=torch.float64)
    totals = summed_over_ranks(totals)
    state.step += 1
    state.examples_seen += t.memories_per_step
    state.index_checksum += int(totals[2].item())  # global, so every rank's checkpointed state is the same
    loss = totals[0].item() / world
    state.loss_first = loss if state.loss_first is None else state.loss_first
    part_values = {n: v / world for n, v in zip(names, totals[3:].tolist(), strict=True)}
    state.parts_first = state.parts_first or dict(part_values)
    elapsed = time.perf_counter() - started
    return {"step": state.step, "loss": loss, "loss_first": state.loss_first, "lr": max(engine.get_lr()),
            "tokens_per_s": totals[1].item() / elapsed, "step_seconds": elapsed,
            "examples_seen": state.examples_seen, "index_checksum": float(state.index_checksum), **part_values,
            **{f"{n}_first": v for n, v in state.parts_first.items()}}


def resumed_state(engine, world: int, average: WeightAverage | None = None) -> TrainState:
    """The checkpoint's state, refused when it was trained on another number of workers: a sharded corpus stream
    deals its row groups by the world size, so only the same one resumes exactly (ZeRO shards need it too)."""
    state = restore_checkpoint(engine, TrainState, average)
    if state.world and state.world != world:
        raise ValueError(f"the checkpoint was written by {state.world} workers and this run has {world}: resume with "
                         f"--scaling.num_workers {state.world}, or start a new run (another --run.name)")
    state.world = world
    return state
