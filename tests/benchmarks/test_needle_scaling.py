"""benchmarks/needle_scaling.py as a user runs it: two phases (the base task, then a larger mixed memory), saved,
scored at two sizes with the routers' recall; then (slow) continued from the saved model, read with full attention,
and the router's mix trained."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> dict:
    done = subprocess.run([sys.executable, "benchmarks/needle_scaling.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_trains_in_phases_saves_scores_each_size_and_the_routers_recall(tmp_path):
    model = "memory_top_k=2,memory_summaries=4,memory_routing_grad=1"
    first = run("--model", model, "--phase", "2:", "--phase", "2:memory_scale_max=2,variants=single+multi_key",
                "--memories", "2", "--scales", "1", "2", "--recall", "--save", str(tmp_path / "m"))
    assert set(first["accuracy"]) == {"single/1x", "single/2x", "multi_key/1x", "multi_key/2x", "no_memory"}
    assert all(0.0 <= v <= 1.0 for v in first["accuracy"].values())
    # tiny-shared's GCA blocks sit in its upper half (layers 2 and 3): one recall per routing layer and cell
    assert {cell: sorted(layers) for cell, layers in first["recall"].items()} == {
        cell: ["2", "2/full", "3", "3/full"] for cell in ("single/1x", "single/2x", "multi_key/1x", "multi_key/2x")}
    # at 1x the memory is 4 chunks and k = 2 of them, at 2x 8: the recall is a share of questions either way
    assert all(0.0 <= v <= 1.0 for layers in first["recall"].values() for v in layers.values())


@pytest.mark.slow
def test_a_saved_model_is_scored_again_read_with_full_attention_and_the_routers_mix_trains(tmp_path):
    model = "memory_top_k=2,memory_summaries=4,memory_routing_grad=1"
    first = run("--model", model, "--phase", "2:", "--memories", "2", "--scales", "1", "--save", str(tmp_path / "m"))
    again = run("--model", model, "--init-from", str(tmp_path / "m"), "--memories", "2", "--scales", "1")
    assert again["accuracy"]["single/1x"] == first["accuracy"]["single/1x"]  # the saved model, scored again
    full = run("--model", model, "--init-from", str(tmp_path / "m"), "--memories", "2", "--scales", "1",
               "--read-top-k", "0", "--variants", "single")
    assert set(full["accuracy"]) == {"single/1x", "no_memory"}  # the same weights read with full attention
    # rows F-G of docs/evaluation.md: the router's mix and a summary key per token (chunk_len 24), trained and scored
    mixed = run("--model", "memory_top_k=2,memory_summaries=24,memory_chunk_weights=router,memory_routing_loss=0",
                "--phase", "2:", "--memories", "2", "--scales", "1", "--recall", "--variants", "multi_key")
    assert set(mixed["accuracy"]) == {"multi_key/1x", "no_memory"} and set(mixed["recall"]) == {"multi_key/1x"}
