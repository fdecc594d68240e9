"""A sweep's report: the rank x placement table printed on the console and the same grid as a plot for MLflow."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
import numpy as np  # noqa: E402


def format_table(rows: list[dict[str, Any]], metric: str, accuracy: str = "needle_accuracy") -> str:
    """Markdown, one line per trial, sorted by rank then placement; no_memory_val_loss beside the metric says what
    reading the memory is worth."""
    columns = ["lora_rank", "placement", "gca_layers", "lr", metric, accuracy, "no_memory_val_loss", "steps",
               "stopped_early", "seconds", "cpu_seconds", "trial_id"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in sorted(rows, key=lambda r: (r["lora_rank"], r["placement"])):
        cells = [f"{r.get(c):.3g}" if isinstance(r.get(c), float) and c not in ("seconds", "cpu_seconds")
                 else str(r.get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], metric: str):
    """Rank x placement heat map of the best metric each cell reached (blank: not sampled)."""
    ranks = sorted({r["lora_rank"] for r in rows})
    placements = sorted({r["placement"] for r in rows})
    grid = np.full((len(ranks), len(placements)), np.nan)
    for r in rows:
        if r[metric] is not None:
            i, j = ranks.index(r["lora_rank"]), placements.index(r["placement"])
            grid[i, j] = r[metric] if np.isnan(grid[i, j]) else min(grid[i, j], r[metric])
    figure, axis = plt.subplots(figsize=(1.6 * len(placements) + 2, 0.6 * len(ranks) + 2))
    image = axis.imshow(grid, cmap="viridis_r", aspect="auto")
    axis.set_xticks(range(len(placements)), placements, rotation=30, ha="right")
    axis.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    axis.set(xlabel="GCA placement", ylabel="decoder LoRA rank", title=f"{metric} (last evaluation)")
    for i in range(len(ranks)):
        for j in range(len(placements)):
            if not np.isnan(grid[i, j]):
                axis.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", color="white", fontsize=8)
    figure.colorbar(image, ax=axis)
    return figure
