"""The pictures a run logs: the needle heatmap (depth x memory size) and the gate values over training."""

from __future__ import annotations

from typing import Any

import matplotlib

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
    if results.get("heatmaps"):
        figures["needle_accuracy_by_size.png"] = accuracy_by_size_figure(results)
    if results.get("efficiency"):
        figures["ttft_by_memory_size.png"] = ttft_figure(results)
    return figures
