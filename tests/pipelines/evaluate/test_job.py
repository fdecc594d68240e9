"""jobs/evaluate.py end to end (Ray Data actors, results.json, plots, MLflow) on exports of the tiny pair, and the
job's config errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.data.synthetic_needles import NeedleSpec
from pipelines.cli import field_docs, from_typed_dict
from pipelines.evaluate.job import SUITES, EvaluateConfig
from pipelines.train.configs.stage import ModelConfig, NeedleConfig, StageConfig
from pipelines.train.model import build_model
from pipelines.train.recipes.stage import write_system

ROOT = Path(__file__).resolve().parents[3]
SPEC = NeedleSpec()


def export_of(tmp_path: Path, checkpoint_root: Path, memory: str = "gca", **model) -> Path:
    """A (random) stage-0 export as the stage job writes it: the added weights and its system.json; `model`: more
    ModelConfig fields by their flags' names (chunk routing's memory_top_k, say)."""
    fields = dict(pair="tiny", checkpoint_root=str(checkpoint_root), memory=memory, gca_layers="upper_half",
                  gca_gate_init=0.3, decoder="full", **model)
    model_config = from_typed_dict(ModelConfig, fields)
    config = StageConfig(model=model_config, needle=NeedleConfig())
    directory = tmp_path / ("-".join(["export", memory, *(f"{k}-{v}" for k, v in model.items())]))
    build_model(config.model).save_pretrained(directory)
    write_system(directory, config)
    return directory


def test_the_suites_are_named_once():
    """SUITES is the one list of suites: each module's suite under its own name, in the order they run, which the
    --help line of --suite lists too."""
    assert list(SUITES) == ["needle", "code_qa", "efficiency", "commits"]
    assert all(name == suite.name for name, suite in SUITES.items())
    assert field_docs(EvaluateConfig)["suite"].startswith(", ".join(SUITES) + " ")


def test_config_errors_name_the_field():
    assert ("suite 'bogus' is not one of ('needle', 'code_qa', 'efficiency', 'commits')"
            in " ".join(EvaluateConfig(model=["x"], suite=["needle,bogus"]).problems()))
    assert "model: name at least one system" in EvaluateConfig().problems()[0]
    code_qa = " ".join(EvaluateConfig(model=["x"], suite=["code_qa"]).problems())
    assert "code_qa.corpus" in code_qa, code_qa  # a suite that needs a corpus says which flag names it


@pytest.mark.ray
@pytest.mark.e2e
def test_evaluate_job_writes_results_plots_and_mlflow(tmp_path, checkpoint_root):
    """The issue's command on a stage-0 export and a baseline's, through Ray Data actors; the training run gets the
    metrics too when the model is named by run id."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    gca = export_of(tmp_path, checkpoint_root, "gca")
    client = MlflowClient(uri)
    experiment = client.create_experiment("stage0")
    run = client.create_run(experiment)
    client.log_artifacts(run.info.run_id, str(export_of(tmp_path, checkpoint_root, "rag")), "export")
    client.set_terminated(run.info.run_id)
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "evaluate.py"), "--model", str(gca), run.info.run_id,
         "--suite", "needle,efficiency", "--out", str(out), "--needle.memories", "2", "--needle.multipliers", "1", "4",
         "--needle.variants", "single", "variable_tracking", "--needle.hops", "2", "--efficiency.memory_tokens", "96",
         "480", "--efficiency.repeats", "1", "--efficiency.encoder_chunks", "16", "--tracking_uri", uri],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    progress = [line for line in result.stdout.splitlines() if line.startswith("gca: needle  ")]
    assert progress[0] == "gca: needle  0/8 probes  elapsed 0m00s"
    assert progress[-1].startswith("gca: needle  8/8 probes")
    results = json.loads((out / "results.json").read_text())
    assert set(results["systems"]) == {"gca", "rag"} == set(summary["systems"])
    for name, entry in results["systems"].items():
        metrics = entry["metrics"]
        for size in ("1x", "4x"):
            assert 0 <= metrics[f"needle/single/{size}"] <= 1
            assert entry["counts"][f"needle/single/{size}"] == 2 * SPEC.questions
            assert 0 <= metrics[f"needle/variable_tracking_2/{size}"] <= 1
        assert len(metrics["needle/single/1x/ci95"]) == 2
        assert metrics["efficiency/ttft_s/96"] > 0 and metrics["efficiency/ttft_s/480"] > 0
    assert results["systems"]["gca"]["metrics"]["efficiency/encoder_chunks_per_s"] > 0
    assert results["heatmaps"]["gca"]["memory_tokens"] == [96, 384]
    for picture in ("needle_heatmap_gca.png", "needle_heatmap_rag.png", "needle_accuracy_by_size.png",
                    "ttft_by_memory_size.png"):
        assert (out / picture).stat().st_size > 1000, picture
    logged = client.get_run(summary["mlflow_run_id"])
    assert logged.data.metrics["gca/needle/single/1x"] == results["systems"]["gca"]["metrics"]["needle/single/1x"]
    assert ({a.path for a in client.list_artifacts(logged.info.run_id)}
            >= {"results.json", "needle_accuracy_by_size.png", "needle_table.md"})
    table = (out / "needle_table.md").read_text().splitlines()  # every task and system, rag with its recall
    assert table[0] == "| task | system | 1x | 4x |" and len(table) == 2 + 2 * 2
    assert any(line.startswith("| single | rag | ") and "(r 1.00)" in line for line in table)
    trained = client.get_run(run.info.run_id)  # the evaluated training run carries its own results
    assert trained.data.metrics["eval/needle/single/4x"] == results["systems"]["rag"]["metrics"]["needle/single/4x"]
    assert trained.data.tags["eval.run_id"] == logged.info.run_id
    assert not [line for line in result.stdout.splitlines() if "Running Dataset" in line or "%|" in line]


def test_evaluate_refuses_a_missing_model_with_exit_2(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / "evaluate.py"), "--model", str(tmp_path / "nope"),
                             "--track", "false", "--out", str(tmp_path / "o")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "not an export directory, a run id" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["error"]
