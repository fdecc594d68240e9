"""The traffic-scene VLM job's recipe: SigLIP vision tower -> classic cross-attention decoder, trained on the
[YES]/[NO] logits of rendered scenes (Ray Data), evaluated on held-out seeds with and without the image, exported
as a whole model with its tokenizer, and logged as a registered-model-ready pyfunc."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import SequenceClassifierOutput

from models.traffic_vlm import TrafficVLM, build_traffic_vlm, tiny_vision_config
from pipelines.data.traffic_scenes import QUESTIONS, build_split, make_row, pixel_values, scene_seeds
from pipelines.data.traffic_tokenizer import NO, PAD, YES, build_traffic_tokenizer, save_traffic_tokenizer
from pipelines.evaluate import plots
from pipelines.evaluate.collectives import summed_over_ranks
from pipelines.serving.traffic_pyfunc import log_traffic_pyfunc
from pipelines.tracking.lineage import git_commit, system_info
from pipelines.tracking.tracker import Tracker
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.recipes import Loss, Prepared, TrainState, model_loss, trainable_groups
from pipelines.train.streams import DatasetStream

GROUP = "traffic_vlm"  # everything trains in full, at the schedule's rate
EVAL_BATCH = 64
COUNTS = ("tp", "fp", "tn", "fn")  # YES is the positive class


class YesNoObjective(nn.Module):
    """What the engine trains: the VLM, its loss the cross-entropy over the [YES]/[NO] logits (labels: 0 = YES,
    1 = NO)."""

    def __init__(self, vlm: TrafficVLM):
        super().__init__()
        self.vlm = vlm

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                answer_positions: torch.Tensor | None = None) -> SequenceClassifierOutput:
        """labels (B,) for one question a row, or (B, Q) for rows packing Q questions (`collate_scene_questions`)."""
        logits = self.vlm.yes_no_logits(pixel_values, input_ids, attention_mask, position_ids=position_ids,
                                        answer_positions=answer_positions)  # (B, 2) or (B, Q, 2)
        return SequenceClassifierOutput(loss=F.cross_entropy(logits.reshape(-1, 2), labels.reshape(-1)),
                                        logits=logits)


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
        return int((batch["input_ids"] != _tokenizer().token_to_id(PAD)).sum())

    def probe(self, engine, config: TrafficConfig, state: TrainState, stream) -> dict[str, float]:
        return {}

    def evaluate(self, engine, config: TrafficConfig, rank: int, world: int) -> dict[str, float]:
        """Held-out accuracy with the image and with it withheld, majority rate, F1 (YES positive) and accuracy per
        question type; every rank scores its share of the held-out seeds, the counts are summed over ranks."""
        return heldout_metrics(engine.module.vlm, config, rank, world)

    def export(self, engine, config: TrafficConfig, worker: dict[str, Any], directory: Path) -> None:
        """The whole model (vision/, decoder/, traffic_vlm.json) and tokenizer.json, written by rank 0."""
        vlm: TrafficVLM = engine.module.vlm
        with deepspeed.zero.GatheredParameters(list(vlm.parameters()), enabled=config.deepspeed.zero_stage == 3):
            if dist.get_rank() == 0:
                vlm.save_pretrained(directory)
                save_traffic_tokenizer(directory)
        dist.barrier()

    def finish(self, engine, config: TrafficConfig, state: TrainState, tracker: Tracker, rank: int,
               world: int) -> None:
        """Rank 0 draws the held-out grid (question, prediction, truth) and the cross-attention maps over patches."""
        vlm: TrafficVLM = engine.module.vlm
        with deepspeed.zero.GatheredParameters(list(vlm.parameters()), enabled=config.deepspeed.zero_stage == 3):
            if rank == 0 and tracker.client is not None:
                log_scene_figures(vlm, config, tracker)

    def summary(self, config: TrafficConfig, metrics: dict[str, Any], export_dir: str | None,
                tracker: Tracker) -> dict[str, Any]:
        """The export and the pyfunc on the run (registered when tracking.registered_model names a model), the
        confusion matrix and the per-type table; the job's fields of the summary line."""
        per_type = {q: metrics.get(f"accuracy/{q}") for q in config.data.question_types}
        log_confusion(tracker, metrics)
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


# ---------------------------------------------------------------------------------------------- model and data
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


def collate(rows: dict[str, Any], image_size: int) -> dict[str, torch.Tensor]:
    """Columns png, question, answer -> pixel_values (B, 3, S, S) in [-1, 1], right-padded question ids and mask,
    labels (0 = YES, 1 = NO)."""
    encodings = _tokenizer().encode_batch([str(q) for q in rows["question"]])
    return {"pixel_values": torch.from_numpy(pixel_values(list(rows["png"]), size=image_size)),
            "input_ids": torch.tensor([e.ids for e in encodings]),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings]),
            "labels": torch.tensor([0 if a == "yes" else 1 for a in rows["answer"]])}


def collate_scene_questions(rows: dict[str, Any], image_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Columns png, scene_questions, scene_answers -> one row per scene asking all of its questions at once, in an
    order shuffled by `rng`: input_ids (B, T) of the questions one after another, each `[BOS] words`; position_ids
    restarting at 0 for each (and for the [PAD] tail); answer_positions (B, Q) of each question's last token;
    labels (B, Q), 0 = YES. No attention_mask: the model keeps each question's attention within itself.

    Why: a scene then trains Q answers for one pass of the vision tower and of the memory's K/V, and the answers
    of one image differ only by the question, which shortens the plateau before the decoder learns to look (the
    needle notes measured the same for text memories)."""
    tokenizer, pad = _tokenizer(), _tokenizer().token_to_id(PAD)
    ids, positions, answer_positions, labels = [], [], [], []
    for questions, answers in zip(rows["scene_questions"], rows["scene_answers"]):
        row_ids, row_positions, row_answers, row_labels = [], [], [], []
        for k in rng.permutation(len(questions)):
            question = tokenizer.encode(str(questions[k]), add_special_tokens=True).ids
            row_ids += question
            row_positions += range(len(question))
            row_answers.append(len(row_ids) - 1)
            row_labels.append(0 if answers[k] == "yes" else 1)
        ids.append(row_ids), positions.append(row_positions), answer_positions.append(row_answers)
        labels.append(row_labels)
    width = max(map(len, ids))
    for row_ids, row_positions in zip(ids, positions):
        tail = width - len(row_ids)
        row_ids += [pad] * tail
        row_positions += range(tail)  # the [PAD] tail is a segment of its own: no question attends to it
    return {"pixel_values": torch.from_numpy(pixel_values(list(rows["png"]), size=image_size)),
            "input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions),
            "answer_positions": torch.tensor(answer_positions), "labels": torch.tensor(labels)}


@functools.lru_cache(maxsize=1)
def _tokenizer():
    return build_traffic_tokenizer()


@functools.lru_cache(maxsize=2)
def heldout_rows(seeds: tuple[int, ...], image_size: int, question_types: tuple[str, ...]) -> dict[str, list]:
    """Held-out scenes rendered by make_row, the function Ray Data renders the training scenes with; kept as PNG
    bytes for the run (a worker evaluates the same seeds every time)."""
    rows = [make_row(s, question_types=question_types) for s in seeds]
    return {key: [r[key] for r in rows] for key in ("png", "question", "answer", "seed")}


def rank_seeds(config: TrafficConfig, rank: int, world: int) -> tuple[int, ...]:
    d = config.data
    return tuple(scene_seeds("heldout", d.heldout_scenes, d.heldout_fraction)[rank::world])


@torch.no_grad()
def predictions(vlm: TrafficVLM, rows: dict[str, list], image_size: int, *, withhold_image: bool) -> torch.Tensor:
    """(N,) bool, True = [YES], over rows in batches of EVAL_BATCH."""
    out = []
    for start in range(0, len(rows["png"]), EVAL_BATCH):
        batch = collate({k: v[start:start + EVAL_BATCH] for k, v in rows.items()}, image_size)
        device = next(vlm.parameters()).device
        out.append(vlm.classify(batch["pixel_values"].to(device), batch["input_ids"].to(device),
                                batch["attention_mask"].to(device), withhold_image=withhold_image).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def heldout_metrics(vlm: TrafficVLM, config: TrafficConfig, rank: int, world: int) -> dict[str, float]:
    was_training = vlm.training
    vlm.eval()
    types = tuple(config.data.question_types)
    rows = heldout_rows(rank_seeds(config, rank, world), config.model.image_size, types)
    truth = torch.tensor([a == "yes" for a in rows["answer"]], dtype=torch.bool)
    seen = predictions(vlm, rows, config.model.image_size, withhold_image=False)
    withheld = predictions(vlm, rows, config.model.image_size, withhold_image=True)
    vlm.train(was_training)
    counts = count_outcomes(seen, withheld, truth, rows["question"], types)
    counts = summed_over_ranks(counts)
    return metrics_from_counts(counts, types)


def count_outcomes(seen: torch.Tensor, withheld: torch.Tensor, truth: torch.Tensor, questions: list[str],
                   types: tuple[str, ...]) -> torch.Tensor:
    """(4 + 3 * types,) float64: tp fp tn fn, then per type (scenes, right with the image, right without)."""
    counts = [(seen & truth).sum(), (seen & ~truth).sum(), (~seen & ~truth).sum(), (~seen & truth).sum()]
    for kind in types:
        of_type = torch.tensor([q == QUESTIONS[kind] for q in questions], dtype=torch.bool)
        counts += [of_type.sum(), ((seen == truth) & of_type).sum(), ((withheld == truth) & of_type).sum()]
    return torch.tensor([float(c) for c in counts], dtype=torch.float64)


def metrics_from_counts(counts: torch.Tensor, types: tuple[str, ...]) -> dict[str, float]:
    tp, fp, tn, fn = counts[:4].tolist()
    per_type = counts[4:].view(len(types), 3).tolist()
    total = tp + fp + tn + fn
    precision, recall = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
    metrics = {"accuracy": (tp + tn) / total, "no_image_accuracy": sum(r[2] for r in per_type) / total,
               "majority_accuracy": max(tp + fn, fp + tn) / total, "precision": precision, "recall": recall,
               "f1": 2 * precision * recall / max(precision + recall, 1e-12), "heldout_scenes": total,
               **{f"confusion/{name}": value for name, value in zip(COUNTS, (tp, fp, tn, fn))}}
    for kind, (n, right, right_withheld) in zip(types, per_type):
        metrics[f"accuracy/{kind}"] = right / max(n, 1)
        metrics[f"no_image_accuracy/{kind}"] = right_withheld / max(n, 1)
    return metrics


# ---------------------------------------------------------------------------------------------- figures
def log_confusion(tracker: Tracker, metrics: dict[str, Any]) -> None:
    if not all(f"confusion/{name}" in metrics for name in COUNTS):
        return
    tp, fp, tn, fn = (int(metrics[f"confusion/{name}"]) for name in COUNTS)
    figure = plots.confusion_figure(np.array([[tp, fn], [fp, tn]]), ["YES", "NO"])
    tracker.log_figure(figure, "confusion_matrix.png")
    plots.close(figure)


def log_scene_figures(vlm: TrafficVLM, config: TrafficConfig, tracker: Tracker) -> None:
    """The first data.grid_scenes held-out scenes with their question, prediction and truth, and the last decoder
    layer's cross-attention over the patches for the first few of them."""
    was_training = vlm.training
    vlm.eval()
    d, size = config.data, config.model.image_size
    seeds = scene_seeds("heldout", d.grid_scenes, d.heldout_fraction)
    rows = heldout_rows(tuple(seeds), size, tuple(d.question_types))
    batch = collate(rows, size)
    device = next(vlm.parameters()).device
    inputs = [batch[k].to(device) for k in ("pixel_values", "input_ids", "attention_mask")]
    said = vlm.classify(*inputs).cpu().tolist()
    attention = vlm.cross_attention_map(*inputs).cpu().numpy()  # (N, patches)
    vlm.train(was_training)
    images = [np.asarray(pixel_values([png])[0].transpose(1, 2, 0) * 0.5 + 0.5) for png in rows["png"]]
    captions = [f"{q}\nsaid {'yes' if s else 'no'}, truth {a}" for q, s, a in zip(rows["question"], said, rows["answer"])]
    for name, figure in (("heldout_grid.png", plots.scene_grid_figure(images, captions,
                                                                      [s == (a == "yes") for s, a in zip(said, rows["answer"])])),
                         ("cross_attention.png", plots.attention_overlay_figure(images[:4], attention[:4],
                                                                                 rows["question"][:4]))):
        tracker.log_figure(figure, name)
        plots.close(figure)
