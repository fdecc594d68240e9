"""The Ray Train worker loop: DeepSpeed (ZeRO-3 by default) over the AwarenessModel, resumable and fault-tolerant.

`train_loop_per_worker` reads as a table of contents; each helper below it does one thing.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from models import AwarenessModel, LoraPlan, LoraSettings, apply_lora, build_pair, set_trainable
from models.awareness import WEIGHTS_NAME
from models.trainable import is_added_parameter, parameter_group
from pipelines.config import ModelConfig, StageConfig
from pipelines.evaluation import NeedleScores, score_needles
from pipelines.streams import CorpusStream, NeedleStream, evaluate_corpus
from pipelines.tracking import Tracker

ENGINE_TAG = "engine"
STATE_FILE = "trainer_state.json"
EXPORT_DIR = "export"


@dataclass
class TrainState:
    """What a checkpoint carries besides the engine's shards: where the data stream stands and what was seen."""

    step: int = 0
    examples_seen: int = 0  # memories consumed by all workers
    index_checksum: int = 0  # sum of the example indices consumed: a skipped or repeated example changes it
    gate_history: list[list[float]] = field(default_factory=list)  # [step, |tanh(gate)| per GCA layer...]


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    import ray.train

    config = StageConfig.from_dict(loop_config["config"])
    quiet_known_warnings()
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    torch.manual_seed(config.train.seed)
    model = build_model(config.model)
    engine = setup_deepspeed(model, config)
    state = restore_checkpoint(engine)
    stream = CorpusStream(config, rank, world, state.step) if config.data.train_path else NeedleStream(config, rank, world)
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
            heatmap = needle_heatmap(engine.module, config, rank, world)
        if logging_step:
            tracker.log_metrics(metrics, state.step)
        if state.step % config.train.checkpoint_every == 0 or final:
            save_checkpoint(engine, state, metrics, faults=faults,
                            export=functools.partial(export_artifact, engine, config) if final else None)
        elif logging_step:
            ray.train.report(metrics)
    finish_tracking(tracker, state, rank, engine.module.gca_layers, heatmap)
    tracker.save_pending(loop_config.get("tracking_pending"))  # the driver retries what the server refused


# --------------------------------------------------------------------------------------------------- setup
def quiet_known_warnings() -> None:
    """DeepSpeed 0.19 calls two torch.distributed collectives that torch 2.13 deprecates, at every step; the
    FutureWarnings would bury the log. Only those two are silenced."""
    warnings.filterwarnings(
        "ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
    )


def build_model(cfg: ModelConfig) -> AwarenessModel:
    """The pair, its LoRA adapters and what trains, all from the model config."""
    model = build_pair(cfg.pair, checkpoint_root=cfg.checkpoint_root, gca_layers=cfg.gca_layers,
                       encoder_attention=cfg.encoder_attention, gca_mlp=cfg.gca_mlp,
                       encoder_checkpoint=cfg.encoder_checkpoint)
    return prepare_model(model, cfg)


def prepare_model(model: AwarenessModel, cfg: ModelConfig) -> AwarenessModel:
    """The training configuration on a built pair: LoRA adapters, initial added weights, what trains, the encoder's
    gradient scale and gradient checkpointing (benchmarks apply it to pairs built with random weights on a GPU)."""
    targets = tuple(cfg.lora_targets.split(","))
    plan = LoraPlan(
        decoder=LoraSettings(rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=targets) if cfg.decoder == "lora" else None,
        gca=LoraSettings(rank=cfg.gca_lora_rank) if cfg.gca == "lora" else None,
        encoder=LoraSettings(rank=cfg.encoder_lora_rank) if cfg.encoder == "lora" else None,
    )
    if plan.decoder or plan.gca or plan.encoder:
        apply_lora(model, plan)
    if cfg.gca_gate_init:
        model.set_gates(cfg.gca_gate_init)
    if cfg.init_from:
        model.load_added_weights(Path(cfg.init_from) / WEIGHTS_NAME)
    set_trainable(model, decoder=cfg.decoder, encoder=cfg.encoder, gca=cfg.gca)
    model.memory_encoder.grad_scale = cfg.encoder_grad_scale
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model


def deepspeed_config(config: StageConfig, world: int) -> dict[str, Any]:
    t, ds = config.train, config.deepspeed
    bf16 = ds.precision == "bf16" or (ds.precision == "auto" and torch.cuda.is_available())
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": t.memories_per_step // (world * t.grad_accum),
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def setup_deepspeed(model: AwarenessModel, config: StageConfig):
    """A torch AdamW with one parameter group per part (GCA, decoder, encoder) and a cosine schedule, handed to
    DeepSpeed: no DeepSpeed optimizer op to JIT-build. The decoder group's learning rate stays 0 for the plan's
    warm-up phase (train.frozen_decoder_steps)."""
    import deepspeed
    import torch.distributed as dist

    groups: dict[str, list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault(parameter_group(name), []).append(param)
    t = config.train
    optimizer = torch.optim.AdamW(
        [{"params": params, "name": name} for name, params in groups.items()], lr=t.lr, weight_decay=t.weight_decay
    )
    schedules = [_lr_lambda(t, frozen=t.frozen_decoder_steps if name == "decoder" else 0) for name in groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
    if config.deepspeed.zero_stage == 3:
        mark_zero3_leaf_modules(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=deepspeed_config(config, dist.get_world_size()))
    return engine


def mark_zero3_leaf_modules(model: AwarenessModel) -> None:
    """Qwen3-MoE's sparse block runs only the experts its tokens route to, so ranks would wait on different
    parameter gathers and hang: ZeRO-3 must gather the whole block at once (a leaf module)."""
    from deepspeed.utils import set_z3_leaf_modules
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if any(isinstance(m, Qwen3MoeSparseMoeBlock) for m in model.modules()):
        set_z3_leaf_modules(model, [Qwen3MoeSparseMoeBlock])


def _lr_lambda(t, frozen: int):
    def factor(step: int) -> float:
        if step < frozen:
            return 0.0
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


# ---------------------------------------------------------------------------------------------------- steps
def train_step(engine, config: StageConfig, state: TrainState, stream) -> dict[str, float]:
    import torch.distributed as dist

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
    import deepspeed
    import torch.distributed as dist

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


HEATMAP_DISTRACTORS = (0, 2, 6, 14)  # memory sizes for the final needle heatmap, in filler chunks added


def needle_heatmap(model: AwarenessModel, config: StageConfig, rank: int, world: int) -> dict[str, Any]:
    """Needle accuracy by depth and memory size, on held-out memories (the needle-in-a-haystack picture)."""
    import dataclasses

    import torch.distributed as dist

    indices = list(range(rank, config.needle.val_memories, world))
    base, columns = config.needle.spec(), []
    for distractors in HEATMAP_DISTRACTORS:
        spec = dataclasses.replace(base, distractors=distractors)
        scores = score_needles(model, spec, config.needle.seed + 1, indices)
        total = scores.as_tensor()
        dist.all_reduce(total)
        scores = NeedleScores.from_tensor(total, bins=len(scores.depth_total))
        columns.append([c / max(n, 1) for c, n in zip(scores.depth_correct, scores.depth_total, strict=True)])
    sizes = [dataclasses.replace(base, distractors=d).chunks * base.chunk_len for d in HEATMAP_DISTRACTORS]
    return {"memory_tokens": sizes, "accuracy_by_depth": [list(row) for row in zip(*columns)]}


def evaluate(model: AwarenessModel, config: StageConfig, rank: int, world: int) -> dict[str, float]:
    """Held-out needles (or the corpus' validation shard), with the memory and with it withheld, summed over
    workers (each scores its share)."""
    import torch.distributed as dist

    if config.data.train_path:
        return evaluate_corpus(model, config, rank, world)

    indices = list(range(rank, config.needle.val_memories, world))
    metrics = {}
    for label, with_memory in (("needle", True), ("no_memory", False)):
        scores = score_needles(model, config.needle.spec(), config.needle.seed + 1, indices, with_memory=with_memory)
        total = scores.as_tensor()
        dist.all_reduce(total)
        scores = NeedleScores.from_tensor(total, bins=len(scores.depth_total))
        metrics[f"{label}_accuracy"] = scores.accuracy
        metrics[f"{label}_val_loss"] = scores.loss
        if with_memory:
            for b, (c, n) in enumerate(zip(scores.depth_correct, scores.depth_total, strict=True)):
                metrics[f"needle_accuracy/depth_{b}"] = c / max(n, 1)
    return metrics


# ----------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(engine, state, metrics: dict[str, float], *, export: Callable[[Path], None] | None = None,
                    faults: "FaultInjector | None" = None) -> None:
    """Every worker writes its ZeRO shard into its own directory and reports it; Ray Train registers the checkpoint
    only once every worker has reported, so one that a dying worker left incomplete is never resumed from.
    `export(directory)` (final checkpoints) adds what users load; the stage and UL2 loops share this."""
    import ray.train
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp, tag=ENGINE_TAG, client_state={"trainer_state": asdict(state)})
        if dist.get_rank() == 0:
            (Path(tmp) / STATE_FILE).write_text(json.dumps(asdict(state)))
        if export is not None:
            export(Path(tmp) / EXPORT_DIR)
        if faults is not None:
            faults.maybe_fail("save", state.step)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def restore_checkpoint(engine, state_cls: type = TrainState):
    """Model, optimizer, scheduler and the loop's state (a `state_cls`, saved as client state "trainer_state") from
    the latest registered checkpoint, if any. The UL2 job shares it with its own state class."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return state_cls()
    with checkpoint.as_directory() as directory:
        _, client_state = engine.load_checkpoint(directory, tag=ENGINE_TAG)
    return state_cls(**client_state["trainer_state"])


def export_artifact(engine, config: StageConfig, directory: Path) -> None:
    """The small artifact (GCA, projection, LoRA, any base weight trained in full), gathered from the ZeRO-3 shards
    and written by rank 0 with AwarenessModel.save_pretrained: it reloads without DeepSpeed."""
    import deepspeed
    import torch.distributed as dist

    model: AwarenessModel = engine.module
    params = [p for n, p in model.named_parameters() if is_added_parameter(n) or p.requires_grad]
    with deepspeed.zero.GatheredParameters(params, enabled=config.deepspeed.zero_stage == 3):
        if dist.get_rank() == 0:
            model.save_pretrained(directory)
    dist.barrier()


def finish_tracking(tracker: Tracker, state: TrainState, rank: int, layers: list[int],
                    heatmap: dict[str, Any] | None = None) -> None:
    if rank != 0 or tracker.client is None or not state.gate_history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if heatmap is not None:
        tracker.log_dict(heatmap, "needle_heatmap.json")
        figure, axis = plt.subplots(figsize=(5, 3.5))
        grid = axis.imshow(heatmap["accuracy_by_depth"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
        bins = len(heatmap["accuracy_by_depth"])
        axis.set(xticks=range(len(heatmap["memory_tokens"])), xticklabels=heatmap["memory_tokens"],
                 yticks=range(bins), yticklabels=[f"{i / bins:.2f}-{(i + 1) / bins:.2f}" for i in range(bins)],
                 xlabel="memory size (tokens)", ylabel="needle depth", title="Held-out needle exact match")
        figure.colorbar(grid, ax=axis)
        tracker.log_figure(figure, "needle_heatmap.png")
        plt.close(figure)

    history = torch.tensor(state.gate_history)
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for column, layer in enumerate(layers, start=1):
        axis.plot(history[:, 0], history[:, column], label=f"decoder layer {layer}")
    axis.set(xlabel="step", ylabel="|tanh(gate)|", title="How much each GCA block reads the memory")
    axis.legend(fontsize=7)
    tracker.log_figure(figure, "gates.png")
    plt.close(figure)


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
