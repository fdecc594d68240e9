"""The embedded default's learning claim, at full length (~12 minutes on 2 quiet cores, Nov 27 2026):
`make test-slow`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.train.presets import STAGE0

pytestmark = pytest.mark.ray  # every test here starts Ray

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
@pytest.mark.timeout(2700)  # the run alone took over 15 min on 2 quiet cores (Nov 23 2026), past pytest's 900 s default
def test_default_stage0_run_learns_to_read_its_memory(tmp_path):
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / "stage0.py"), "--run.storage_path",
                             str(tmp_path / "ray"), "--tracking.tracking_uri", tracking_uri],
                            cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(summary))  # shown by `pytest -rA`: the numbers docs/jobs.md reports
    assert summary["needle_accuracy"] >= 0.9, summary
    # whole answers (the value, then EOS) on the largest memories it trains on, and the mixture's other tasks
    largest = f"{STAGE0.needle.memory_scale_max}x"
    assert summary[f"needle_accuracy/{largest}"] >= 0.9, summary
    assert summary[f"needle_accuracy/multi_key/{largest}"] >= 0.9, summary
    assert summary["needle_accuracy/multi_value"] >= 0.8 and summary["needle_accuracy/multi_query"] >= 0.8, summary
    assert summary["no_memory_accuracy"] <= 0.2, summary
    assert summary["gate_abs_mean"] > max(0.05, summary["gate_abs_init"] + 0.05), summary  # opened further
    # registered with jobs/register.py and served with `mlflow models serve` (docs/tracking.md's commands): its
    # registry example and fresh needle questions, asked over REST in text
    from pipelines.serving.loopback import ModelServer
    from pipelines.serving.tiny import needle_questions
    from tests.pipelines.serving.test_register import documented_registry_example

    registered = subprocess.run([sys.executable, str(ROOT / "jobs" / "register.py"), "--run_id",
                                 summary["mlflow_run_id"], "--tracking_uri", tracking_uri],
                                cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert registered.returncode == 0, registered.stderr[-3000:]
    version = json.loads(registered.stdout.strip().splitlines()[-1])
    memory, questions, answers = documented_registry_example()
    rows, values = needle_questions(seed=99, memories=8)
    with ModelServer(f"models:/{version['name']}@candidate", tracking_uri, tmp_path) as server:
        assert server.predict([{"question": q, "memory": memory} for q in questions]) == answers
        served = server.predict(rows)
    accuracy = sum(a == v for a, v in zip(served, values, strict=True)) / len(values)
    print(json.dumps({"rest_needle_accuracy": accuracy, "questions": len(values)}))
    assert accuracy >= 0.9, list(zip(served, values))
