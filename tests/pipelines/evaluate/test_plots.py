"""The pictures a run logs (pipelines/evaluate/plots.py): the files jobs/evaluate.py writes for a hand-written
results.json, each line and label where the numbers put it, and the traffic VLM's figures drawn from a real scene."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from pipelines.data.traffic_scenes import make_row
from pipelines.evaluate import plots

RESULTS = {
    "systems": {
        "gca": {"metrics": {"needle/single/1x": 0.9, "needle/single/4x": 0.5, "needle/single/16x": 0.2,
                            "needle/multi_value/1x": 0.7, "needle/multi_value/1x/ci95": [0.5, 0.8],
                            "efficiency/ttft_s/96": 0.01}},
        "rag": {"metrics": {"needle/single/4x": 0.4, "needle/single/1x": 0.6}},
    },
    "heatmaps": {"gca": {"memory_tokens": [96, 384], "accuracy_by_depth": [[1.0, 0.5], [0.75, 0.25]]}},
    "efficiency": {"gca": [{"memory_tokens": 96, "ttft_s": 0.01}, {"memory_tokens": 480, "ttft_s": 0.02}],
                   "none": [{"memory_tokens": 96, "ttft_s": 0.005}]},
}


def test_evaluation_figures_by_file_name():
    figures = plots.evaluation_figures(RESULTS)
    assert sorted(figures) == ["needle_accuracy_by_size.png", "needle_heatmap_gca.png", "ttft_by_memory_size.png"]
    heatmap = figures["needle_heatmap_gca.png"].axes[0]
    assert heatmap.get_title() == "gca: single-needle exact match"
    assert [t.get_text() for t in heatmap.get_xticklabels()] == ["96", "384"]
    assert [t.get_text() for t in heatmap.get_yticklabels()] == ["0.00-0.50", "0.50-1.00"]  # two depth bins
    assert heatmap.images[0].get_array().tolist() == [[1.0, 0.5], [0.75, 0.25]]
    ttft = figures["ttft_by_memory_size.png"].axes[0]
    assert {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ttft.lines} == {
        "gca": ([96, 480], [10.0, 20.0]), "none": ([96], [5.0])}  # milliseconds
    for figure in figures.values():
        plots.close(figure)
    assert plots.evaluation_figures({"systems": {}}) == {}


def test_a_suite_without_single_draws_its_sizes_and_no_empty_heatmap():
    """The heatmap is single's by depth: without single there is none (it was an empty picture), and the sizes
    figure still draws the tasks that were asked."""
    results = {"systems": {"gca": {"metrics": {"needle/multi_key/1x": 0.9, "needle/multi_key/4x": 0.8}}}}
    figures = plots.evaluation_figures(results)
    assert sorted(figures) == ["needle_accuracy_by_size.png"]
    assert [axis.get_title() for axis in figures["needle_accuracy_by_size.png"].axes] == ["multi_key"]
    plots.close(figures["needle_accuracy_by_size.png"])


def test_accuracy_by_size_has_a_panel_per_variant_and_a_line_per_system():
    figure = plots.accuracy_by_size_figure(RESULTS)
    panels = {axis.get_title(): axis for axis in figure.axes}
    assert sorted(panels) == ["multi_value", "single"]  # the /ci95 entry is no point
    single = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in panels["single"].lines}
    assert single == {"gca": ([1, 4, 16], [0.9, 0.5, 0.2]), "rag": ([1, 4], [0.6, 0.4])}  # sorted by size
    assert [line.get_label() for line in panels["multi_value"].lines] == ["gca"]
    plots.close(figure)


def test_gate_figure_draws_a_line_per_layer():
    figure = plots.gate_figure([[0, 0.29, 0.3], [50, 0.4, 0.1], [100, 0.6, 0.05]], layers=[2, 3])
    lines = figure.axes[0].lines
    assert [line.get_label() for line in lines] == ["decoder layer 2", "decoder layer 3"]
    assert list(lines[0].get_xdata()) == [0, 50, 100] and list(lines[1].get_ydata()) == [0.3, 0.1, 0.05]
    plots.close(figure)


def test_figures_draw(tmp_path):
    image = np.asarray(Image.open(io.BytesIO(make_row(0)["png"])), dtype=np.float32) / 255
    for name, figure in (("confusion.png", plots.confusion_figure(np.array([[5, 1], [2, 4]]), ["YES", "NO"])),
                         ("grid.png", plots.scene_grid_figure([image] * 3, ["a", "b", "c"], [True, False, True])),
                         ("attention.png", plots.attention_overlay_figure([image] * 2, np.full((2, 196), 1 / 196),
                                                                          ["q1", "q2"]))):
        figure.savefig(tmp_path / name)
        plots.close(figure)
        assert Image.open(tmp_path / name).size[0] > 100
    confusion = plots.confusion_figure(np.array([[5, 1], [2, 4]]), ["YES", "NO"])
    assert [t.get_text() for t in confusion.axes[0].texts] == ["5", "1", "2", "4"]  # row = truth, column = answer
    plots.close(confusion)
