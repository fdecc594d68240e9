"""A sweep's report: the fusion x rank x placement table printed on the console and the same grid as a plot for
MLflow."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
import numpy as np  # noqa: E402


def format_table(rows: list[dict[str, Any]], metric: str, accuracy: str = "needle_accuracy") -> str:
    """Markdown, one line per trial, sorted by fusion, rank, then placement; no_memory_val_loss beside the metric says
    what reading the memory is worth. gca_layers: the layers that read the memory (all of them for cross, merged);
    memory_top_k: the chunks each query read (0: all)."""
    columns = ["fusion", "lora_rank", "placement", "gca_layers", "memory_top_k", "lr", metric, accuracy,
               "no_memory_val_loss", "steps", "stopped_early", "seconds", "cpu_seconds", "trial_id"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in sorted(rows, key=lambda r: (_fusion(r), r["lora_rank"], r["placement"])):
        r = {**r, "fusion": _fusion(r), "memory_top_k": r.get("memory_top_k") or 0}  # older rows: no routing
        cells = [f"{r.get(c):.3g}" if isinstance(r.get(c), float) and c not in ("seconds", "cpu_seconds")
                 else str(r.get(c)) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fusion(row: dict[str, Any]) -> str:
    return row.get("fusion") or "gca"


def _column(row: dict[str, Any]) -> str:
    """A heat-map column: the GCA placement, or the fusion that reads in every layer."""
    return row["placement"] if _fusion(row) == "gca" else f"{_fusion(row)} (every layer)"


def plot_sweep(rows: list[dict[str, Any]], metric: str):
    """Rank x (fusion, placement) heat map of the best metric each cell reached (blank: not sampled): GCA trials by
    placement, cross and merged trials (which read in every layer) in a column each."""
    ranks = sorted({r["lora_rank"] for r in rows})
    placements = sorted({_column(r) for r in rows}, key=lambda c: (" (every layer)" in c, c))
    grid = np.full((len(ranks), len(placements)), np.nan)
    for r in rows:
        if r[metric] is not None:
            i, j = ranks.index(r["lora_rank"]), placements.index(_column(r))
            grid[i, j] = r[metric] if np.isnan(grid[i, j]) else min(grid[i, j], r[metric])
    figure, axis = plt.subplots(figsize=(1.6 * len(placements) + 2, 0.6 * len(ranks) + 2))
    image = axis.imshow(grid, cmap="viridis_r", aspect="auto")
    axis.set_xticks(range(len(placements)), placements, rotation=30, ha="right")
    axis.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    axis.set(xlabel="fusion / GCA placement", ylabel="decoder LoRA rank", title=f"{metric} (last evaluation)")
    for i in range(len(ranks)):
        for j in range(len(placements)):
            if not np.isnan(grid[i, j]):
                axis.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", color="white", fontsize=8)
    figure.colorbar(image, ax=axis)
    return figure
