"""`ray job submit --working-dir .` against a local head node that this test starts and stops by PID.

Its own --temp-dir and ports, and token authentication (Ray's default for local clusters) with a token of its own;
never `ray stop`, which would kill every Ray process on the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ray]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def head_node(tmp_path):
    ray_bin = Path(sys.executable).parent / "ray"
    port, dashboard = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           # as in an activated venv: the job's `python` entrypoint is this interpreter, not the system's
           "PATH": f"{ray_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    temp_dir = Path("/tmp") / f"ray-test-{secrets.token_hex(3)}"  # short: Ray's socket paths have a length limit
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard}",
         "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--temp-dir={temp_dir}", "--num-cpus=2",
         "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            status = subprocess.run([str(ray_bin), "job", "list", "--address", address], env=env,
                                    capture_output=True, text=True)
            if status.returncode == 0:
                break
            assert head.poll() is None, "ray start --head exited"
            time.sleep(2)
        else:
            pytest.fail("the local head node's job server did not come up in 120 s")
        yield address, env, ray_bin
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # our head and what it started, by process group
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


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
