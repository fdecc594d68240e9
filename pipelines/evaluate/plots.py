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
