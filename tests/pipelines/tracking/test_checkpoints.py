"""A short stage-0 run leaves every checkpoint on its MLflow run as Ray Train persists it (URI on the storage path,
step, validation metrics), the tags follow Ray Train's retention, and jobs/register.py --step registers the chosen
checkpoint's export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.tracking.checkpoints import LATEST_TAG, RECORDS, record_name, step_tag
from pipelines.train.configs.common import RunSettings, TrackingSettings, TrainConfig
from pipelines.train.configs.stage import ModelConfig, NeedleConfig, StageConfig

pytestmark = [pytest.mark.ray, pytest.mark.e2e]  # a stage-0 run through Ray Train

ROOT = Path(__file__).resolve().parents[3]
NAME = "awareness-checkpoint-test"


@pytest.fixture(scope="module")
def finished(tmp_path_factory, checkpoint_root, mlflow_server):
    """6 steps, a checkpoint every 2 (each evaluated), Ray Train keeping the last 2."""
    import ray

    from pipelines.train.recipes.jobs import train

    tmp = tmp_path_factory.mktemp("checkpoints")
    config = StageConfig(
        model=ModelConfig(pair="tiny", checkpoint_root=str(checkpoint_root), gca_layers="upper_half"),
        needle=NeedleConfig(facts=4, questions=4, val_memories=8),
        train=TrainConfig(max_steps=6, memories_per_step=8, warmup_steps=2, log_every=2, eval_every=2,
                          checkpoint_every=2),
        run=RunSettings(name="recorded", storage_path=str(tmp / "ray"), keep_checkpoints=2),
        tracking=TrackingSettings(tracking_uri=mlflow_server.uri, experiment="checkpoint-test"),
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        summary = train(config)
    finally:
        ray.shutdown()  # only this test's local instance; never `ray stop`
    assert summary["error"] is None and summary["steps"] == 6
    return summary, tmp


def records(client, run_id: str, tmp: Path) -> dict[int, dict]:
    found = {}
    for artifact in client.list_artifacts(run_id, RECORDS):
        record = json.loads(Path(client.download_artifacts(run_id, artifact.path, str(tmp))).read_text())
        found[record["step"]] = record
    return found


def test_every_checkpoint_is_on_the_run_with_its_uri_step_and_validation(finished, mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    summary, _ = finished
    client = MlflowClient(mlflow_server.uri)
    run_id = summary["mlflow_run_id"]
    recorded = records(client, run_id, tmp_path)
    assert sorted(recorded) == [2, 4, 6]  # every checkpoint ever written
    for step, record in recorded.items():
        assert record["uri"].startswith(str(Path(summary["checkpoint"]).parent)) and "checkpoint_" in record["uri"]
        assert record["metrics"]["step"] == step
        assert record["validation"]["step"] == step  # evaluated at the checkpoint's own step
        assert 0 <= record["validation"]["needle_accuracy"] <= 1 and "no_memory_accuracy" in record["validation"]
        assert record["export"] == f"{record['uri']}/export"
    assert recorded[6]["uri"] == summary["checkpoint"]
    history = {m.step: m.value for m in client.get_metric_history(run_id, "needle_accuracy")}
    assert {s: recorded[s]["validation"]["needle_accuracy"] for s in recorded} == history  # the same numbers

    tags = client.get_run(run_id).data.tags
    assert tags[LATEST_TAG] == summary["checkpoint"]
    # Ray Train kept the last 2: their tags name checkpoints that exist, step 2's went with its checkpoint
    assert step_tag(2) not in tags and not Path(recorded[2]["uri"]).exists()
    for step in (4, 6):
        assert tags[step_tag(step)] == recorded[step]["uri"]
        assert (Path(recorded[step]["uri"]) / "export" / "awareness.safetensors").is_file()


def register(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "register.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_register_step_registers_that_checkpoints_export(finished, mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    summary, _ = finished
    run_id, uri = summary["mlflow_run_id"], mlflow_server.uri
    result = register("--run_id", run_id, "--step", "4", "--name", NAME, "--tracking_uri", uri, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    line = json.loads(result.stdout.strip().splitlines()[-1])
    client = MlflowClient(uri)
    version = client.get_model_version(NAME, line["version"])
    checkpoint = client.get_run(run_id).data.tags[step_tag(4)]
    assert version.tags["checkpoint.step"] == "4" and version.tags["checkpoint.uri"] == checkpoint
    assert version.source.endswith("/pyfunc/step_4") and version.run_id == run_id
    # the registered model carries exactly that checkpoint's export (not the final one, which differs)
    model_dir = Path(client.download_artifacts(run_id, "pyfunc/step_4", str(tmp_path)))
    weights = next(model_dir.rglob("awareness.safetensors")).read_bytes()
    assert weights == (Path(checkpoint) / "export" / "awareness.safetensors").read_bytes()
    assert weights != (Path(summary["checkpoint"]) / "export" / "awareness.safetensors").read_bytes()


def test_register_step_of_a_deleted_or_unknown_checkpoint_says_why(finished, mlflow_server, tmp_path):
    summary, _ = finished
    common = ("--run_id", summary["mlflow_run_id"], "--name", NAME, "--tracking_uri", mlflow_server.uri)
    deleted = register(*common, "--step", "2", cwd=tmp_path)
    assert deleted.returncode == 2 and "no longer exists" in deleted.stderr
    assert "--run.keep_checkpoints" in deleted.stderr
    unknown = register(*common, "--step", "5", cwd=tmp_path)
    assert unknown.returncode == 2 and "steps [2, 4, 6]" in unknown.stderr, unknown.stderr[-2000:]


def test_record_names_sort_by_step():
    assert record_name(200) < record_name(1000) and record_name(7) == "checkpoints/step_00000007.json"
