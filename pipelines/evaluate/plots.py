"""The pictures a run logs: the needle heatmap (depth x memory size), the gate values over training, and the traffic
VLM's confusion matrix, held-out scene grid and cross-attention overlay."""

from __future__ import annotations

from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)


def needle_heatmap_figure(heatmap: dict[str, Any]):
    figure, axis = plt.subplots(figsize=(5, 3.5))
    grid = axis.imshow(heatmap["accuracy_by_depth"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
    bins = len(heatmap["accuracy_by_depth"])
    axis.set(xticks=range(len(heatmap["memory_tokens"])), xticklabels=heatmap["memory_tokens"],
             yticks=range(bins), yticklabels=[f"{i / bins:.2f}-{(i + 1) / bins:.2f}" for i in range(bins)],
             xlabel="memory size (tokens)", ylabel="needle depth", title="Held-out needle exact match")
    figure.colorbar(grid, ax=axis)
    return figure


def gate_figure(gate_history: list[list[float]], layers: list[int]):
    """gate_history rows: [step, |tanh(gate)| per GCA layer...]."""
    figure, axis = plt.subplots(figsize=(6, 3.5))
    steps = [row[0] for row in gate_history]
    for column, layer in enumerate(layers, start=1):
        axis.plot(steps, [row[column] for row in gate_history], label=f"decoder layer {layer}")
    axis.set(xlabel="step", ylabel="|tanh(gate)|", title="How much each GCA block reads the memory")
    axis.legend(fontsize=7)
    return figure


def close(figure) -> None:
    plt.close(figure)


def accuracy_by_size_figure(results: dict[str, Any]):
    """Needle exact match against memory size, one line per system, one panel per variant."""
    systems = results["systems"]
    variants = sorted({key.split("/")[1] for entry in systems.values() for key in entry["metrics"]
                       if key.startswith("needle/") and key.endswith("x")})
    figure, axes = plt.subplots(1, max(len(variants), 1), figsize=(3.2 * max(len(variants), 1), 3), sharey=True,
                                squeeze=False)
    for axis, variant in zip(axes[0], variants, strict=False):
        for system, entry in systems.items():
            points = sorted((int(key.split("/")[2][:-1]), value) for key, value in entry["metrics"].items()
                            if key.startswith(f"needle/{variant}/") and key.endswith("x"))
            if points:
                axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
        axis.set(xscale="log", xlabel="memory size (x training)", title=variant, ylim=(-0.03, 1.03))
    axes[0][0].set_ylabel("exact match")
    axes[0][0].legend(fontsize=7)
    return figure


def ttft_figure(results: dict[str, Any]):
    """Time to first token against memory size, one line per system."""
    figure, axis = plt.subplots(figsize=(5, 3.5))
    for system, rows in results["efficiency"].items():
        axis.plot([r["memory_tokens"] for r in rows], [r["ttft_s"] * 1000 for r in rows], marker="o", label=system)
    axis.set(xscale="log", yscale="log", xlabel="memory size (tokens)", ylabel="time to first token (ms)",
             title="Time to first token")
    axis.legend(fontsize=7)
    return figure


def evaluation_figures(results: dict[str, Any]) -> dict[str, Any]:
    """The pictures jobs/evaluate.py writes and logs, by file name."""
    figures = {}
    for system, heatmap in results.get("heatmaps", {}).items():
        figure = needle_heatmap_figure(heatmap)
        figure.axes[0].set_title(f"{system}: single-needle exact match")
        figures[f"needle_heatmap_{system}.png"] = figure
    if any(key.startswith("needle/") for entry in results["systems"].values() for key in entry["metrics"]):
        figures["needle_accuracy_by_size.png"] = accuracy_by_size_figure(results)
    if results.get("efficiency"):
        figures["ttft_by_memory_size.png"] = ttft_figure(results)
    return figures


def confusion_figure(matrix, labels: list[str]):
    """matrix[i][j]: scenes whose truth is labels[i] answered labels[j]."""
    figure, axis = plt.subplots(figsize=(3.6, 3.2))
    axis.imshow(matrix, cmap="Blues")
    for (i, j), value in np.ndenumerate(matrix):
        axis.text(j, i, str(value), ha="center", va="center", color="black")
    axis.set(xticks=range(len(labels)), xticklabels=labels, yticks=range(len(labels)), yticklabels=labels,
             xlabel="answered", ylabel="truth", title="Held-out confusion matrix")
    return figure


def scene_grid_figure(images: list, captions: list[str], correct: list[bool], columns: int = 4):
    """Images (H, W, 3) in [0, 1] with their captions; a wrong answer's caption in red."""
    rows = -(-len(images) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3 * columns, 3.4 * rows), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for axis, image, caption, ok in zip(axes.flat, images, captions, correct):
        axis.imshow(image)
        axis.set_title(caption, fontsize=8, color="black" if ok else "red")
    return figure


def attention_overlay_figure(images: list, attention, questions: list[str]):
    """Each image beside its cross-attention over the patches (attention: (N, patches), a square grid), overlaid."""
    figure, axes = plt.subplots(1, max(len(images), 1), figsize=(3.2 * max(len(images), 1), 3.4), squeeze=False)
    for axis, image, weights, question in zip(axes[0], images, attention, questions):
        side = int(round(len(weights) ** 0.5))
        height, width = image.shape[:2]
        axis.imshow(image)
        axis.imshow(np.asarray(weights).reshape(side, side), cmap="inferno", alpha=0.55, extent=(0, width, height, 0),
                    interpolation="nearest")
        axis.set_title(question, fontsize=8)
        axis.axis("off")
    figure.suptitle("Cross-attention of the answer position over the image patches (last layer)", fontsize=9)
    return figure
