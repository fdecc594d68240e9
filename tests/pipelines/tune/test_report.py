"""A sweep's report (pipelines/tune/report.py) on hand-written trial rows: the table's order (fusion, rank, then
placement), its number formats and a column per field; the plot's grid holds each cell's best metric, blank where
nothing was sampled."""

from __future__ import annotations

import numpy as np

from pipelines.tune.report import format_table, plot_sweep

ROWS = [
    {"trial_id": "a", "lora_rank": 16, "placement": "upper_half", "gca_layers": [2, 3], "lr": 1e-3,
     "needle_val_loss": 2.0, "needle_accuracy": 0.5, "steps": 8, "stopped_early": False, "seconds": 10.0,
     "cpu_seconds": 10.0, "export": "/x", "error": None, "mlflow_run_id": "r1"},
    {"trial_id": "b", "lora_rank": 8, "placement": "last:1", "gca_layers": [3], "lr": 1e-3,
     "needle_val_loss": 1.0, "needle_accuracy": 0.1, "steps": 4, "stopped_early": True, "seconds": 5.0,
     "cpu_seconds": 5.0, "export": None, "error": None, "mlflow_run_id": "r2"},
]


def cells(table: str) -> list[dict[str, str]]:
    """The markdown table as one dict per trial, by column name."""
    header, _, *lines = table.splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    return [dict(zip(names, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines]


def test_table_and_plot():
    rows = list(ROWS)
    lines = format_table(rows, "needle_val_loss").splitlines()  # rows without a fusion were GCA's
    assert lines[2].startswith("| gca | 8 | last:1 | [3] | 0 |")
    assert lines[3].startswith("| gca | 16 | upper_half | [2, 3] |")
    rows.append({**rows[0], "trial_id": "c", "fusion": "cross", "lora_rank": 8, "gca_layers": [0, 1, 2, 3]})
    lines = format_table(rows, "needle_val_loss").splitlines()
    assert lines[-1].startswith("| gca | 16 |") and lines[2].startswith("| cross | 8 | upper_half | [0, 1, 2, 3] |")
    figure = plot_sweep(rows, "needle_val_loss")  # a column per GCA placement, one for cross
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == ["last:1", "upper_half", "cross (every layer)"]


def test_table_cells_by_hand():
    rows = [{**ROWS[0], "needle_val_loss": 2.34567, "no_memory_val_loss": 3.0, "seconds": 12.3456, "memory_top_k": 4},
            {**ROWS[1], "fusion": "merged", "needle_val_loss": None}]
    table = format_table(rows, "needle_val_loss", accuracy="corpus_token_accuracy")
    assert table.splitlines()[1] == "|" + "---|" * len(table.splitlines()[0].strip("|").split("|"))
    gca, merged = cells(table)  # gca sorts before merged
    assert (gca["fusion"], gca["trial_id"], merged["fusion"], merged["trial_id"]) == ("gca", "a", "merged", "b")
    assert gca["needle_val_loss"] == "2.35" and gca["lr"] == "0.001"  # floats to 3 significant digits
    assert gca["seconds"] == "12.3456" and gca["cpu_seconds"] == "10.0"  # times as measured
    assert gca["no_memory_val_loss"] == "3" and merged["no_memory_val_loss"] == "None"  # a field a trial lacks
    assert gca["corpus_token_accuracy"] == "None" and merged["needle_val_loss"] == "None"
    assert gca["stopped_early"] == "False" and merged["stopped_early"] == "True" and gca["steps"] == "8"
    assert gca["memory_top_k"] == "4" and merged["memory_top_k"] == "0"  # a row from before routing: every chunk


def test_the_plot_grid_keeps_each_cells_best_and_leaves_unsampled_cells_blank():
    rows = [{**ROWS[0], "needle_val_loss": 2.0}, {**ROWS[0], "trial_id": "a2", "needle_val_loss": 1.5},
            {**ROWS[1], "needle_val_loss": 0.7}, {**ROWS[1], "trial_id": "b2", "needle_val_loss": None},
            {**ROWS[0], "trial_id": "c", "fusion": "cross", "lora_rank": 8, "needle_val_loss": 0.9}]
    axis = plot_sweep(rows, "needle_val_loss").axes[0]
    assert [t.get_text() for t in axis.get_yticklabels()] == ["8", "16"]
    grid = axis.images[0].get_array()  # rows: rank 8, 16; columns: last:1, upper_half, cross (every layer)
    values = np.ma.getdata(grid)
    assert values[0][0] == 0.7 and values[1][1] == 1.5 and values[0][2] == 0.9
    blank = np.ma.getmaskarray(grid) | np.isnan(values)
    assert blank.tolist() == [[False, True, False], [True, False, True]]
    assert sorted(t.get_text() for t in axis.texts) == ["0.7", "0.9", "1.5"]  # blank cells get no label
