"""benchmarks/routing_recall.py as its docstring shows it, on tiny routed exports (random weights: the answers are
noise, the bookkeeping is not): the whole answers are the evaluation's own score of the same probes, a router that
reads every chunk recalls every evidence chunk, and an export that does not route is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models import MemoryReading, build_pair
from pipelines.data.synthetic_needles import EQ, NeedleSpec
from pipelines.evaluate.common import load_system
from pipelines.evaluate.needle import NeedleSuite, score_probe

ROOT = Path(__file__).resolve().parents[2]
READING = MemoryReading(top_k=2, chunk_weights="router", lexical_routing=3.0, lexical_gate=True, lexical_tokens=True)


def export(checkpoint_root, tmp_path_factory, reading: MemoryReading) -> Path:
    """A tiny stage-0 pair built with `reading`, saved as a stage job exports it."""
    model = build_pair("tiny-shared", checkpoint_root=checkpoint_root, gca_layers="upper_half",
                       encoder_attention="bidirectional", reading=reading)
    return model.save_pretrained(tmp_path_factory.mktemp("routing_recall") / "export")


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/routing_recall.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def summary_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_answers_are_the_evaluations_and_recalls_are_shares_per_layer_and_head(checkpoint_root, tmp_path_factory):
    routed = export(checkpoint_root, tmp_path_factory, READING)
    summary = summary_of(run_benchmark("--model", str(routed), "--variants", "alias", "two_hop", "--multipliers", "1",
                                       "--memories", "2"))
    assert summary["top_k"] == 2 and set(summary["cells"]) == {"alias@1x", "two_hop@1x"}
    system = load_system("gca", str(routed), {"memory": "gca", "needle": None})
    for variant in ("alias", "two_hop"):
        cell = summary["cells"][f"{variant}@1x"]
        rows = [row for index in range(2) for row in score_probe(system, variant, 1, NeedleSuite().seed, index)]
        assert cell["whole"] == pytest.approx(sum(r["whole"] for r in rows) / len(rows))
        for name in ("router", "attention"):  # two GCA layers (upper half of 4) x two kv heads
            assert set(cell[name]) == {f"layer{i}/head{h}" for i in (2, 3) for h in (0, 1)}
            assert all(0.0 <= v <= 1.0 for v in cell[name].values())
        assert 0.0 <= cell["whole_every_chunk"] <= 1.0
    assert "router_at_named_key" not in summary["cells"]["alias@1x"]  # a chain's second read only
    assert set(summary["cells"]["two_hop@1x"]["router_at_named_key"]) == set(cell["router"])
    assert set(summary["cells"]["two_hop@1x"]["router_in_value"]) == set(cell["router"])
    whole = [row["whole"] for index in range(2) for row in score_probe(system, "two_hop", 1, NeedleSuite().seed, index)]
    assert summary["cells"]["two_hop@1x"]["keys_named_right"] >= sum(whole) / len(whole)  # a whole answer names them


def test_at_the_named_key_every_chunk_read_holds_the_value_s_chunk(checkpoint_root, tmp_path_factory):
    """k at the memory's 4 chunks (1x): at a chain's named key, router and attention read the value's chunk always;
    the chunk counted is the one holding the fact the answer's value comes from."""
    from pipelines.evaluate.needle import make_probe

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from routing_recall import named_key_inputs

    every = export(checkpoint_root, tmp_path_factory, MemoryReading(top_k=4))
    cell = summary_of(run_benchmark("--model", str(every), "--variants", "two_hop", "--multipliers", "1",
                                    "--memories", "2", "--every_chunk", "false"))["cells"]["two_hop@1x"]
    assert set(cell["router_at_named_key"].values()) == set(cell["attention_at_named_key"].values()) == {1.0}
    assert set(cell["router_in_value"].values()) == set(cell["attention_in_value"].values()) == {1.0}
    probe = make_probe("two_hop", NeedleSpec(), 4, NeedleSuite().seed, 0)
    written, _ = named_key_inputs(probe, 2)  # the key, then the value's first two tokens
    for row, path, value in zip(written["input_ids"].tolist(), probe.paths, probe.references, strict=True):
        assert row[-len(path) - 2:] == [*path, *value[0][:2]]
    inputs, chunks = named_key_inputs(probe)
    for row, path, value, (chunk,) in zip(inputs["input_ids"].tolist(), probe.paths, probe.references, chunks,
                                          strict=True):
        assert row[-len(path):] == path
        written = probe.memory[chunk].tolist()
        assert any(written[i : i + 2 + len(value[0])] == [*path, EQ, *value[0]] for i in range(len(written)))


def test_reading_every_chunk_recalls_every_evidence_chunk(checkpoint_root, tmp_path_factory):
    """k at the memory's 4 chunks (1x): every chunk is among the top k, for the router and for full attention."""
    every = export(checkpoint_root, tmp_path_factory, MemoryReading(top_k=4))
    cell = summary_of(run_benchmark("--model", str(every), "--variants", "single", "--multipliers", "1",
                                    "--memories", "2", "--every_chunk", "false"))["cells"]["single@1x"]
    assert set(cell["router"].values()) == set(cell["attention"].values()) == {1.0}
    assert "whole_every_chunk" not in cell


def test_an_export_that_does_not_route_is_refused(checkpoint_root, tmp_path_factory):
    done = run_benchmark("--model", str(export(checkpoint_root, tmp_path_factory, MemoryReading())))
    assert done.returncode == 2 and "not a routed gca export" in done.stderr
