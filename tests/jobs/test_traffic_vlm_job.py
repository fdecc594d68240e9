"""jobs/traffic_vlm.py as a user runs it, through Ray Train + DeepSpeed on 2 CPU workers: a short run's summary line,
its MLflow metrics and figures, and its registered pyfunc answering held-out scenes as the exported model does; the
embedded default's accuracy claim (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from models.traffic_vlm import TrafficVLM
from pipelines.data.traffic_scenes import make_row, pixel_values, scene_seeds
from pipelines.data.traffic_tokenizer import load_traffic_tokenizer
from pipelines.train.presets import TRAFFIC_VLM

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray  # every test here starts Ray
# A small model for a few steps, on two workers (the default's one would skip the gradient exchange and the
# evaluation's split over ranks).
TINY = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.layers", "1", "--model.heads", "4",
        "--model.kv_heads", "2", "--model.image_size", "64", "--data.train_scenes", "64",
        "--data.heldout_scenes", "24", "--data.grid_scenes", "4", "--train.max_steps", "4",
        "--train.memories_per_step", "8", "--train.eval_every", "2", "--train.log_every", "1",
        "--train.warmup_steps", "1",
        "--scaling.num_workers", "2", "--scaling.cpus_per_worker", "1"]
SUMMARY = ("accuracy", "no_image_accuracy", "majority_accuracy", "f1", "steps", "seconds", "mlflow_run_id", "export",
           "error")


def run(tmp_path: Path, *args: str, timeout: int) -> dict:
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / "traffic_vlm.py"), *args,
                             "--run.storage_path", str(tmp_path / "ray")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~2-3 min on 2 loaded cores: Ray, DeepSpeed and MLflow start-up, not the 4 steps
def test_short_run_logs_figures_and_a_pyfunc_that_answers_held_out_scenes(tmp_path):
    summary = run(tmp_path, *TINY, timeout=900)
    assert set(SUMMARY) <= set(summary) and summary["error"] is None and summary["steps"] == 4, summary
    for name in ("accuracy", "no_image_accuracy", "majority_accuracy", "f1"):
        assert 0 <= summary[name] <= 1, name
    assert set(summary["accuracy_by_type"]) == {"light_red", "pedestrian_on_crosswalk", "left_lane_free",
                                                "right_lane_free", "stop_sign", "can_go"}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = summary["mlflow_run_id"]
    artifacts = ({a.path for a in client.list_artifacts(run_id)}
                 | {a.path for a in client.list_artifacts(run_id, "eval")})
    assert {"confusion_matrix.png", "heldout_grid.png", "cross_attention.png", "eval/per_question_type.json", "export",
            "pyfunc", "summary.json"} <= artifacts, artifacts
    history = [m.step for m in client.get_metric_history(run_id, "accuracy")]
    assert history == [2, 4]  # train.eval_every 2 and the last step
    assert client.get_metric_history(run_id, "accuracy/can_go") and client.get_metric_history(run_id, "f1")

    # the registered pyfunc answers as the exported model does
    exported = TrafficVLM.from_pretrained(summary["export"]).eval()
    tokenizer = load_traffic_tokenizer(summary["export"])
    rows = [make_row(s) for s in scene_seeds("heldout", 6)]
    encodings = tokenizer.encode_batch([r["question"] for r in rows])
    with torch.no_grad():
        want = exported.classify(torch.from_numpy(pixel_values([r["png"] for r in rows], size=64)),
                                 torch.tensor([e.ids for e in encodings]),
                                 torch.tensor([e.attention_mask for e in encodings]))
    assert summary["registered"] == "models:/traffic-vlm/1"
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        served = mlflow.pyfunc.load_model("models:/traffic-vlm@candidate")
    finally:
        mlflow.set_tracking_uri(None)
    answers = served.predict(pd.DataFrame({"image": [r["png"] for r in rows],
                                           "question": [r["question"] for r in rows]}))
    assert answers == ["yes" if w else "no" for w in want.tolist()]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the default run is ~10 min on 2 quiet cores; a loaded machine stretches it several-fold
def test_embedded_default_answers_held_out_scenes_from_the_image(tmp_path):
    """The issue's must-show: `python jobs/traffic_vlm.py` reaches held-out accuracy >= 0.9, and the same model
    with its vision tokens zeroed stays near the majority rate (<= 0.6)."""
    summary = run(tmp_path, timeout=3300)
    assert summary["error"] is None and summary["steps"] == TRAFFIC_VLM.train.max_steps, summary
    assert summary["accuracy"] >= 0.9, summary
    assert summary["no_image_accuracy"] <= 0.6, summary
    assert summary["majority_accuracy"] <= 0.6, summary  # balanced held-out split: the claim is not the base rate
