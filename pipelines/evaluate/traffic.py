"""The traffic VLM's evaluation: held-out scenes answered with the image and with it withheld, scored as accuracy,
majority rate, precision, recall and F1 (YES the positive class) and accuracy per question type (every rank scores
its share, the counts summed over ranks); the held-out grid, attention and confusion figures."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from models.traffic_vlm import TrafficVLM
from pipelines.data.traffic_batches import collate, heldout_rows
from pipelines.data.traffic_scenes import QUESTIONS, pixel_values
from pipelines.evaluate import plots
from pipelines.evaluate.collectives import summed_over_ranks

EVAL_BATCH = 64
COUNTS = ("tp", "fp", "tn", "fn")  # YES is the positive class


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


def heldout_metrics(vlm: TrafficVLM, seeds: tuple[int, ...], image_size: int,
                    types: tuple[str, ...]) -> dict[str, float]:
    """Accuracy with the image and with it withheld, majority rate, F1 (YES positive) and accuracy per question type
    over this rank's held-out `seeds`, the counts summed over ranks."""
    was_training = vlm.training
    vlm.eval()
    rows = heldout_rows(seeds, image_size, types)
    truth = torch.tensor([a == "yes" for a in rows["answer"]], dtype=torch.bool)
    seen = predictions(vlm, rows, image_size, withhold_image=False)
    withheld = predictions(vlm, rows, image_size, withhold_image=True)
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


def confusion_figures(metrics: dict[str, Any]) -> dict[str, Any]:
    """{"confusion_matrix.png": figure} from the metrics' confusion counts ({} without them)."""
    if not all(f"confusion/{name}" in metrics for name in COUNTS):
        return {}
    tp, fp, tn, fn = (int(metrics[f"confusion/{name}"]) for name in COUNTS)
    return {"confusion_matrix.png": plots.confusion_figure(np.array([[tp, fn], [fp, tn]]), ["YES", "NO"])}


def scene_figures(vlm: TrafficVLM, rows: dict[str, list], size: int) -> dict[str, Any]:
    """{file name: figure}: held-out scenes with their question, prediction and truth, and the last decoder layer's
    cross-attention over the patches for the first few of them."""
    was_training = vlm.training
    vlm.eval()
    batch = collate(rows, size)
    device = next(vlm.parameters()).device
    inputs = [batch[k].to(device) for k in ("pixel_values", "input_ids", "attention_mask")]
    said = vlm.classify(*inputs).cpu().tolist()
    attention = vlm.cross_attention_map(*inputs).cpu().numpy()  # (N, patches)
    vlm.train(was_training)
    images = [np.asarray(pixel_values([png])[0].transpose(1, 2, 0) * 0.5 + 0.5) for png in rows["png"]]
    captions = [f"{q}\nsaid {'yes' if s else 'no'}, truth {a}"
                for q, s, a in zip(rows["question"], said, rows["answer"])]
    correct = [s == (a == "yes") for s, a in zip(said, rows["answer"])]
    return {"heldout_grid.png": plots.scene_grid_figure(images, captions, correct),
            "cross_attention.png": plots.attention_overlay_figure(images[:4], attention[:4], rows["question"][:4])}
