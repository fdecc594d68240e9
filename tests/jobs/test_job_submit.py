"""`ray job submit --working-dir .` against a local head node that this test starts and stops by process group
(tests/jobs/ray_nodes.py: its own temp dir and ports, never `ray stop`), with token authentication (Ray's default for
local clusters) and a token of its own."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

import pytest

from tests.jobs.ray_nodes import RAY, ray_cluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture
def head_node():
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           # as in an activated venv: the job's `python` entrypoint is this interpreter, not the system's
           "PATH": f"{RAY.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with ray_cluster(nodes=1, cpus_per_node=2, env=env) as address:
        yield address, env, RAY


def test_stage0_through_ray_job_submit(head_node, tmp_path, checkpoint_root):
    address, env, ray_bin = head_node
    result = subprocess.run(
        [str(ray_bin), "job", "submit", "--address", address, "--working-dir", str(ROOT), "--",
         "python", "jobs/stage0.py", "--train.max_steps", "2", "--train.eval_every", "2",
         "--train.checkpoint_every", "2", "--needle.val_memories", "8",
         "--model.checkpoint_root", str(checkpoint_root), "--run.storage_path", str(tmp_path / "ray"),
         "--tracking.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"job": "stage0"')]
    assert summaries and summaries[-1]["steps"] == 2 and summaries[-1]["error"] is None
