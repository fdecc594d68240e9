"""The traffic-scene VLM job's recipe: SigLIP vision tower -> classic cross-attention decoder, trained on the
[YES]/[NO] logits of rendered scenes (Ray Data), evaluated on held-out seeds with and without the image, exported
as a whole model with its tokenizer, and logged as a registered-model-ready pyfunc."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from models.traffic_vlm import TrafficVLM, YesNoObjective, build_traffic_vlm, tiny_vision_config
from pipelines.data.traffic_batches import collate, collate_scene_questions, heldout_rows
from pipelines.data.traffic_scenes import build_split, scene_seeds
from pipelines.data.traffic_tokenizer import (NO, PAD, YES, build_traffic_tokenizer, save_traffic_tokenizer,
                                              traffic_tokenizer)
from pipelines.evaluate import plots
from pipelines.evaluate.traffic import confusion_figures, heldout_metrics, scene_figures
from pipelines.tracking.lineage import git_commit, system_info
from pipelines.tracking.registry import log_traffic_pyfunc
from pipelines.tracking.tracker import Tracker
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.recipes import Loss, Prepared, TrainState, model_loss, trainable_groups
from pipelines.train.streams import DatasetStream

GROUP = "traffic_vlm"  # everything trains in full, at the schedule's rate


class TrafficRecipe:
    """The traffic VLM job: Recipe (pipelines.train.recipes) for YesNoObjective on rendered scenes."""

    def parse(self, data: dict[str, Any]) -> TrafficConfig:
        return TrafficConfig.from_dict(data)

    def prepare(self, config: TrafficConfig) -> Prepared:
        """The training scenes rendered once by Ray Data and materialised on the driver (streaming tasks would find
        no CPU left once the workers hold a small node's cores, as the UL2 job's data)."""
        run = dataclasses.replace(config.run, storage_path=str(Path(config.run.storage_path).expanduser().resolve()))
        model = config.model
        if model.vision_path:
            model = dataclasses.replace(model, vision_path=str(Path(model.vision_path).expanduser().resolve()))
        config = dataclasses.replace(config, run=run, model=model)
        d = config.data
        train = build_split("train", d.train_scenes, heldout_fraction=d.heldout_fraction,
                            question_types=tuple(d.question_types)).materialize()
        return Prepared(config, datasets={"train": train},
                        tags={"job": "traffic_vlm", "data.manifest_hash": data_hash(config), "git.commit": git_commit(),
                              **({"base.vision": model.vision_path} if model.vision_path else {}), **system_info()})

    def build_model(self, config: TrafficConfig, worker: dict[str, Any], ds_config: dict[str, Any]) -> nn.Module:
        """Built whole on every worker (18.7M parameters at the defaults), then handed to deepspeed.initialize."""
        vlm = build_vlm(config)
        if config.model.gradient_checkpointing:
            vlm.decoder.activation_checkpointing_enable()  # transformers 5.24 deprecates the gradient_ name
        return YesNoObjective(vlm).train()

    def parameter_groups(self, model: nn.Module) -> dict[str, list[torch.nn.Parameter]]:
        return trainable_groups(model, lambda name: GROUP)

    def stream(self, config: TrafficConfig, worker: dict[str, Any], rank: int, world: int, start_step: int):
        """This worker's shard of the training scenes, shuffled locally; packed rows ask their questions in an order
        drawn row by row from train.seed."""
        size, order = config.model.image_size, np.random.default_rng(config.train.seed)
        rows_to_batch = ((lambda rows: collate_scene_questions(rows, size, order)) if config.data.pack_questions else
                         (lambda rows: collate(rows, size)))
        return DatasetStream(config.train, world, rows_to_batch, shuffle_buffer=config.data.shuffle_buffer)

    def loss(self, engine, config: TrafficConfig, batch: dict[str, torch.Tensor]) -> Loss:
        return model_loss(engine, batch)  # YesNoObjective's cross-entropy over the [YES]/[NO] logits

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        """Question tokens read (the vision tokens are a fixed 196 per scene at the defaults)."""
        return int((batch["input_ids"] != traffic_tokenizer().token_to_id(PAD)).sum())

    def before_step(self, engine, config: TrafficConfig, state: TrainState, stream) -> dict[str, float]:
        return {}

    def probe(self, engine, config: TrafficConfig, state: TrainState, stream) -> dict[str, float]:
        return {}

    def evaluate(self, engine, config: TrafficConfig, rank: int, world: int) -> dict[str, float]:
        """Held-out accuracy with the image and with it withheld, majority rate, F1 (YES positive) and accuracy per
        question type; every rank scores its share of the held-out seeds, the counts are summed over ranks."""
        return heldout_metrics(engine.module.vlm, rank_seeds(config, rank, world), config.model.image_size,
                               tuple(config.data.question_types))

    def export(self, engine, config: TrafficConfig, worker: dict[str, Any], directory: Path) -> None:
        """The whole model (vision/, decoder/, traffic_vlm.json) and tokenizer.json, written by rank 0."""
        vlm: TrafficVLM = engine.module.vlm
        with deepspeed.zero.GatheredParameters(list(vlm.parameters()), enabled=config.deepspeed.stage == 3):
            if dist.get_rank() == 0:
                vlm.save_pretrained(directory)
                save_traffic_tokenizer(directory)
        dist.barrier()

    def finish(self, engine, config: TrafficConfig, state: TrainState, tracker: Tracker, rank: int,
               world: int) -> None:
        """Rank 0 draws the held-out grid (question, prediction, truth) and the cross-attention maps over patches."""
        vlm: TrafficVLM = engine.module.vlm
        with deepspeed.zero.GatheredParameters(list(vlm.parameters()), enabled=config.deepspeed.stage == 3):
            if rank == 0 and tracker.client is not None:
                d = config.data
                seeds = scene_seeds("heldout", d.grid_scenes, d.heldout_fraction)
                rows = heldout_rows(tuple(seeds), config.model.image_size, tuple(d.question_types))
                log_figures(tracker, scene_figures(vlm, rows, config.model.image_size))

    def summary(self, config: TrafficConfig, metrics: dict[str, Any], export_dir: str | None,
                tracker: Tracker) -> dict[str, Any]:
        """The export and the pyfunc on the run (registered when tracking.registered_model names a model), the
        confusion matrix and the per-type table; the job's fields of the summary line."""
        per_type = {q: metrics.get(f"accuracy/{q}") for q in config.data.question_types}
        log_figures(tracker, confusion_figures(metrics))
        tracker.log_table({"question_type": list(per_type), "accuracy": list(per_type.values()),
                           "no_image_accuracy": [metrics.get(f"no_image_accuracy/{q}") for q in per_type]},
                          "eval/per_question_type.json")
        model = {}
        if export_dir and Path(export_dir).is_dir():
            tracker.log_artifacts(export_dir, "export")
            model = log_traffic_pyfunc(tracker, export_dir, config.tracking.registered_model)
        return {**{k: metrics.get(k) for k in SUMMARY_METRICS}, "loss_last": metrics.get("loss"),
                "accuracy_by_type": per_type,
                "export": export_dir, **model}


TRAFFIC = TrafficRecipe()
SUMMARY_METRICS = ("accuracy", "no_image_accuracy", "majority_accuracy", "f1", "precision", "recall", "loss_first")


# ---------------------------------------------------------------------------------------------- helpers
def build_vlm(config: TrafficConfig) -> TrafficVLM:
    m, tokenizer = config.model, build_traffic_tokenizer()
    vision = None if m.vision_path else tiny_vision_config(
        image_size=m.image_size, patch_size=m.patch_size, hidden_size=m.vision_hidden_size, layers=m.vision_layers,
        heads=m.vision_heads)
    return build_traffic_vlm(
        yes_id=tokenizer.token_to_id(YES), no_id=tokenizer.token_to_id(NO), vision_path=m.vision_path,
        vision_config=vision, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, layers=m.layers, heads=m.heads, kv_heads=m.kv_heads,
        max_positions=m.max_positions, pad_token_id=tokenizer.token_to_id(PAD))


def data_hash(config: TrafficConfig) -> str:
    """`synthetic:<hash>` of what decides the scenes (as stage 0's needles), so two runs on the same data match."""

    d = config.data
    key = json.dumps([d.train_scenes, d.heldout_scenes, d.heldout_fraction, d.question_types, config.model.image_size])
    return "synthetic:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def rank_seeds(config: TrafficConfig, rank: int, world: int) -> tuple[int, ...]:
    d = config.data
    return tuple(scene_seeds("heldout", d.heldout_scenes, d.heldout_fraction)[rank::world])


def log_figures(tracker: Tracker, figures: dict[str, Any]) -> None:
    for name, figure in figures.items():
        tracker.log_figure(figure, name)
        plots.close(figure)
