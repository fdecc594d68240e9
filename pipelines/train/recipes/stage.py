"""The stage jobs' recipe (stages 0-2; stage 4 adds its teacher: pipelines.train.recipes.stage4): the Awareness pair,
needle or corpus streams, needle or corpus evaluation, the small GCA/LoRA export, and the lineage tags a registered
model needs."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist

from models import AwarenessModel, get_pair, write_random_checkpoints
from models.kernels import use_liger_kernels
from models.trainable import is_added_parameter, parameter_group
from pipelines.data.memory_modes import RETRIEVER_DIR, SYSTEM_FILE
from pipelines.data.streams import validation_rows
from pipelines.evaluate import plots
from pipelines.evaluate.collectives import summed_over_ranks
from pipelines.evaluate.in_training import base_accuracy, evaluate_corpus, evaluate_needles, needle_heatmap
from pipelines.format.shards import check_splits
from pipelines.evaluate.probes import attention_entropy
from pipelines.tracking.lineage import data_manifest_hash, git_commit, system_info
from pipelines.tracking.tracker import Tracker
from pipelines.train.configs.stage import StageConfig
from pipelines.train.engine import zero3_loading
from pipelines.train.model import build_model
from pipelines.train.plan import plan_for_stage, uses_liger
from pipelines.train.recipes import Loss, Prepared, TrainState, model_loss, trainable_groups
from pipelines.train.recipes.jobs import stage_paths_resolved
from pipelines.train.streams import make_stream, packing_spec

CORPUS_METRICS = ("val_loss", "no_memory_val_loss", "token_accuracy", "no_memory_token_accuracy")
NEEDLE_LOSSES = ("needle_val_loss", "no_memory_val_loss")  # what a sweep ranks needle trials on, and its reference


class StageRecipe:
    """Stages 0-2: Recipe (pipelines.train.recipes) for an AwarenessModel on needles or corpus shards."""

    def parse(self, data: dict[str, Any]) -> StageConfig:
        return StageConfig.from_dict(data)

    def prepare(self, config: StageConfig) -> Prepared:
        config = with_zero_stage(prepare_paths(config))
        check_memory_plan(config)
        check_splits([config.data.train_path, config.data.val_path], hashes=False)  # jobs hash them before this
        return Prepared(config, tags={"stage": str(config.stage), **lineage_tags(config)})

    def build_model(self, config: StageConfig, worker: dict[str, Any], ds_config: dict[str, Any]) -> AwarenessModel:
        """Under ZeRO-3 built straight into partitions: no rank holds the whole pair."""
        if uses_liger(config):
            if not use_liger_kernels():
                raise RuntimeError("model.liger needs Liger-Kernel and a CUDA device: install the CUDA lock "
                                   "(make install LOCK=requirements-cuda.txt) or pass --model.liger false")
        with zero3_loading(ds_config) as partitioner:
            model = build_model(config.model, partitioner=partitioner)
        if compiles_layers(config):
            model.compile_layers()
        return model

    def parameter_groups(self, model: AwarenessModel) -> dict[str, list[torch.nn.Parameter]]:
        return trainable_groups(model, parameter_group)  # gca, decoder (frozen for train.frozen_decoder_steps), encoder

    def stream(self, config: StageConfig, worker: dict[str, Any], rank: int, world: int, start_step: int):
        return make_stream(config, rank, world, start_step, teacher_logits=worker.get("teacher_logits"))

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Decoder tokens the step reads, padding excluded (tok/s means the same for packed and plain rows)."""
        return int((batch["segment_ids"] >= 0).sum()) if "segment_ids" in batch else batch["input_ids"].numel()

    def loss(self, engine, config: StageConfig, batch: dict[str, torch.Tensor]) -> Loss:
        return model_loss(engine, batch)

    def before_step(self, engine, config: StageConfig, state: TrainState, stream) -> dict[str, float]:
        """needle.base_until: every needle.base_check_every steps of the base task, its held-out accuracy; the mixture
        starts at the first check that reaches the bar, at needle.base_steps at the latest. The step is kept in the
        checkpoint's state, so a resumed run draws the data the first one did. With needle.mixture_steps the run
        ends that many steps later, its learning rate held at its peak until the mixture starts (TrainState.decay)."""
        n, metrics = config.needle, {}
        if config.data.train_path or n.base_until <= 0:
            return metrics
        if state.mixture_from is None and state.step >= n.base_steps:
            state.mixture_from = n.base_steps
            metrics["mixture_from"] = state.mixture_from
        elif state.mixture_from is None and state.step and state.step % n.base_check_every == 0:
            metrics["base_check_accuracy"] = base_accuracy(engine.module, n.spec(), n.seed + 1, n.val_memories,
                                                           dist.get_rank(), dist.get_world_size(),
                                                           config.model.memory_mode())
            if metrics["base_check_accuracy"] >= n.base_until:
                state.mixture_from = metrics["mixture_from"] = state.step
        stream.mixture_from = state.mixture_from
        if n.mixture_steps:  # until the mixture starts, the rate holds at its peak and the run may take max_steps
            state.decay = ([state.mixture_from, state.mixture_from + n.mixture_steps] if state.mixture_from is not None
                           else [config.train.max_steps] * 2)
        return metrics

    def probe(self, engine, config: StageConfig, state: TrainState, stream) -> dict[str, float]:
        """Gates and attention entropy: only GCA blocks read the memory through them (not a baseline, nor the cross
        or merged fusions)."""
        reads_through_gates = config.model.memory == "gca" and bool(engine.module.gca_blocks())  # a baseline has
        # GCA blocks it never runs
        metrics = probe_metrics(engine, config, state, stream) if reads_through_gates else {}
        return metrics if state.mixture_from is None else metrics | {"mixture_from": state.mixture_from}

    def evaluate(self, engine, config: StageConfig, rank: int, world: int) -> dict[str, float]:
        """Held-out needles, or the corpus' validation shard, with the memory and with it withheld."""
        if config.data.train_path:
            d = config.data
            rows = validation_rows(d.val_path, d.variants, d.val_examples) if d.val_path else None
            return evaluate_corpus(engine.module, rows, packing_spec(config), config.model.memory_mode())
        return evaluate_needles(engine.module, config.needle.spec(), config.needle.seed + 1, config.needle.val_memories,
                                rank, world, config.model.memory_mode())

    def export(self, engine, config: StageConfig, worker: dict[str, Any], directory: Path) -> None:
        """The small artifact (GCA, projection, LoRA, any base weight trained in full), gathered from the ZeRO-3
        shards and written by rank 0 with AwarenessModel.save_pretrained: it reloads without DeepSpeed."""
        model: AwarenessModel = engine.module
        params = [p for n, p in model.named_parameters() if is_added_parameter(n) or p.requires_grad]
        with deepspeed.zero.GatheredParameters(params, enabled=config.deepspeed.stage == 3):
            if dist.get_rank() == 0:
                model.save_pretrained(directory)
                write_system(directory, config)
        dist.barrier()

    def finish(self, engine, config: StageConfig, state: TrainState, tracker: Tracker, rank: int, world: int) -> None:
        """The needle heatmap (every rank scores its share) and the gates' history, as figures on the run."""
        heatmap = None if config.data.train_path else needle_heatmap(
            engine.module, config.needle.spec(), config.needle.seed + 1, config.needle.val_memories, rank, world,
            config.model.memory_mode())
        if rank == 0 and tracker.client is not None:
            log_figures(tracker, state, engine.module.gca_layers, heatmap)

    def summary(self, config: StageConfig, metrics: dict[str, Any], export_dir: str | None,
                tracker: Tracker) -> dict[str, Any]:
        if export_dir:
            tracker.log_artifacts(export_dir, "export")
        log_evaluation_table(tracker, metrics)
        return {
            "pair": config.model.pair,
            "memory": config.model.memory,
            "fusion": config.model.fusion,
            "needle_accuracy": metrics.get("needle_accuracy"),
            # the mixture's other tasks and its largest memory (whole answers, as needle_accuracy), not the depths
            **{key: value for key, value in metrics.items()
               if key.startswith("needle_accuracy/") and not key.startswith("needle_accuracy/depth_")},
            # train.ema_decay: the last step's own weights, beside the average the fields above read
            **{key: value for key, value in metrics.items() if key.startswith("unaveraged/needle_accuracy")
               and not key.startswith("unaveraged/needle_accuracy/depth_")},
            "no_memory_accuracy": metrics.get("no_memory_accuracy"),
            **({"mixture_from": int(metrics["mixture_from"])} if "mixture_from" in metrics else {}),
            "gate_abs_mean": metrics.get("gate_abs_mean"),
            "gate_abs_init": math.tanh(abs(config.model.gca_gate_init)) if engine_has_gates(config) else None,
            **{key: metrics.get(key) for key in (CORPUS_METRICS if config.data.train_path else NEEDLE_LOSSES)},
            "examples_seen": metrics.get("examples_seen"),
            "index_checksum": metrics.get("index_checksum"),  # which examples were seen: a resumed run's must match
            "export": export_dir,
            # GPU runs: rank 0's measured peak beside the memory plan's (the GPU tests hold them within 15%)
            **({"gpu_peak_gib": metrics.get("gpu_peak_gib"),
                "planned_peak_gib": round(plan_for_stage(config).peak_gib, 2)} if config.scaling.use_gpu else {}),
        }


STAGE = StageRecipe()


# ---------------------------------------------------------------------------------------------- driver side
def prepare_paths(config: StageConfig) -> StageConfig:
    """Every local path absolute, as the dry run shows them (the workers read from their own working directories);
    tiny pairs' random checkpoints written once here, before workers race to do it."""
    config = stage_paths_resolved(config)
    spec = get_pair(config.model.pair)
    if spec.random_weights:
        write_random_checkpoints(spec, Path(config.model.checkpoint_root))
    return config


def with_zero_stage(config: StageConfig) -> StageConfig:
    """deepspeed.zero_stage none: on GPUs the memory plan's choice (ZeRO-2 where the whole pair fits each GPU,
    else 3; `jobs/plan.py` and --dry-run say why), on CPU workers 3."""
    if config.deepspeed.zero_stage is not None:
        return config
    stage = plan_for_stage(config).zero_stage if config.scaling.use_gpu else 3
    return dataclasses.replace(config, deepspeed=dataclasses.replace(config.deepspeed, zero_stage=stage))


def compiles_layers(config: StageConfig) -> bool:
    """model.compile, off unless asked for: on an H200, compiled layers added nothing to Liger's kernels (proto1's
    step 0.821 s with both, 0.823 s with Liger alone), recompiled once per GCA block, and stopped the scale pair's
    stage job with an illegal memory access in an Inductor backward kernel (docs/results/2026-11-28-gpu-h200.md)."""
    return bool(config.model.compile)


def check_memory_plan(config: StageConfig) -> None:
    """A GPU run that cannot fit is refused before any cluster time is spent, with the numbers."""
    if not config.scaling.use_gpu:
        return
    plan = plan_for_stage(config)
    if not plan.fits:
        raise ValueError(
            f"this run does not fit in GPU memory:\n{plan.table()}\nuse LoRA (model.decoder=lora), more workers, "
            f"gradient checkpointing, or deepspeed.offload_optimizer / offload_params"
        )


def write_system(directory: Path, config: StageConfig) -> None:
    """How the exported model reads its memory (gca, or a baseline's prompt memory) and the task it learned, so
    jobs/evaluate.py scores it as the system it was trained as. A dense_rag reader's retriever is copied in
    (RETRIEVER_DIR), so the export, and what registers it, holds everything it reads with."""
    retriever = None
    if config.model.memory == "dense_rag":
        shutil.copytree(config.model.retriever, Path(directory) / RETRIEVER_DIR, dirs_exist_ok=True)
        retriever = RETRIEVER_DIR
    system = {"memory": config.model.memory, "context_budget": config.model.context_budget,
              "rag_k": config.model.rag_k, "retriever": retriever, "reread": config.model.rag_reread,
              "needle": None if config.data.train_path else dataclasses.asdict(config.needle)}
    (Path(directory) / SYSTEM_FILE).write_text(json.dumps(system, indent=1))


def lineage_tags(config: StageConfig) -> dict[str, str]:
    """What a registered model needs to trace: base checkpoints, the previous stage's export it started from, data
    manifest hash, git commit, system info."""
    spec = get_pair(config.model.pair)
    root = config.model.checkpoint_root
    return {"pair": config.model.pair, "decoder": spec.decoder, "encoder": spec.encoder,
            "base.decoder": str(Path(root) / spec.decoder) if root else spec.decoder,
            "base.encoder": str(Path(root) / spec.encoder) if root else spec.encoder,
            "data.manifest_hash": data_manifest_hash(config.data.train_path, dataclasses.asdict(config.needle)),
            "git.commit": git_commit(), **system_info(),
            **({"init_from": str(Path(config.model.init_from).resolve())} if config.model.init_from else {})}


def engine_has_gates(config: StageConfig) -> bool:
    """Whether the trained model has GCA gates (what the summary's gate fields describe)."""
    return config.model.memory == "gca" and config.model.fusion == "gca"


def log_evaluation_table(tracker: Tracker, metrics: dict[str, Any]) -> None:
    """The final evaluation as a table on the run it evaluates: needle accuracy by depth of the fact in memory."""
    depths = sorted(k for k in metrics if k.startswith("needle_accuracy/depth_"))
    if depths:
        tracker.log_table({"depth_bin": [int(k.rsplit("_", 1)[1]) for k in depths],
                           "needle_accuracy": [float(metrics[k]) for k in depths]}, "eval/needle_by_depth.json")


# ---------------------------------------------------------------------------------------------- worker side
def probe_metrics(engine, config: StageConfig, state: TrainState, stream) -> dict[str, float]:
    """Per-layer |tanh(gate)| and the attention entropy over the memory, on one training-shaped batch."""
    model: AwarenessModel = engine.module
    blocks = model.gca_blocks()
    with deepspeed.zero.GatheredParameters([b.gate for b in blocks.values()], enabled=config.deepspeed.stage == 3):
        gates = {i: float(b.gate.detach().float().tanh().abs()) for i, b in blocks.items()}
    entropy = attention_entropy(model, **{k: v.to(engine.device) for k, v in stream.probe_batch().items()})
    entropies = torch.tensor([entropy[i] for i in blocks], dtype=torch.float64)
    entropies = summed_over_ranks(entropies) / dist.get_world_size()
    state.gate_history.append([state.step, *gates.values()])
    metrics = {f"gate/layer_{i}": v for i, v in gates.items()}
    metrics |= {f"attention_entropy/layer_{i}": e for i, e in zip(blocks, entropies.tolist(), strict=True)}
    metrics["gate_abs_mean"] = sum(gates.values()) / len(gates)
    return metrics


def log_figures(tracker: Tracker, state: TrainState, layers: list[int], heatmap: dict[str, Any] | None) -> None:
    if heatmap is not None:
        tracker.log_dict(heatmap, "needle_heatmap.json")
        figure = plots.needle_heatmap_figure(heatmap)
        tracker.log_figure(figure, "needle_heatmap.png")
        plots.close(figure)
    if not state.gate_history:  # a baseline has no gates to show
        return
    figure = plots.gate_figure(state.gate_history, layers)
    tracker.log_figure(figure, "gates.png")
    plots.close(figure)
