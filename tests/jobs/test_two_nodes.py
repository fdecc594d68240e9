"""Stage 2 across two Ray nodes on this machine (two `ray start` processes with their own ports, stopped by process
group, never `ray stop`), submitted with `ray job submit` and sharing one storage path:
one worker process is SIGKILLed mid-run, Ray Train restarts the group from the last checkpoint, and the run ends
with the examples an unkilled run saw. Then stage 1 -> stage 2 through --model.init_from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import mlflow
import pytest

from pipelines.train.hooks import HOOK_ENV
from tests.jobs.ray_nodes import RAY, ray_cluster
from tests.pipelines.train.faults import AWAIT_KILL, KILL_DIR_ENV
from tests.pipelines.train.test_stage_commits import build_commit_corpus

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(2700)]  # five jobs, two of them resumed
CPUS_PER_NODE, CPUS_PER_WORKER = 3, 2  # one training worker fits a node, with a CPU left for Ray's own tasks


@pytest.fixture
def two_nodes():
    # Loopback only, and this process's Ray client reads its auth mode once: the nodes run without tokens.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled",
           "PATH": f"{RAY.parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # the job's `python` is this venv's
    with ray_cluster(nodes=2, cpus_per_node=CPUS_PER_NODE, env=env) as address:
        yield address, env


def submit(address: str, env: dict[str, str], job: str, *args: str, env_vars: dict[str, str] | None = None
           ) -> subprocess.Popen:
    runtime_env = json.dumps({"env_vars": env_vars or {}})
    return subprocess.Popen(
        [str(RAY), "job", "submit", "--address", address, "--working-dir", str(ROOT),
         "--runtime-env-json", runtime_env, "--", "python", f"jobs/{job}.py", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def summary_of(process: subprocess.Popen, job: str, timeout: float = 900) -> dict:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-4000:]
    summaries = [json.loads(line) for line in output.splitlines() if line.startswith(f'{{"job": "{job}"')]
    assert summaries, output[-4000:]
    return summaries[-1]


@pytest.fixture
def corpus(tmp_path) -> Path:
    return build_commit_corpus(tmp_path)  # before the nodes start: the build runs a local Ray of its own


def test_stage2_on_two_nodes_survives_a_killed_worker(corpus, two_nodes, tmp_path, checkpoint_root):
    address, env = two_nodes
    split = corpus
    common = ["--data.train_path", str(split), "--data.val_path", str(split), "--data.max_tokens", "1024",
              "--data.max_chunks", "4", "--data.val_examples", "4", "--train.max_steps", "6",
              "--train.memories_per_step", "2", "--train.eval_every", "6", "--train.checkpoint_every", "2",
              "--train.log_every", "1", "--deepspeed.zero_stage", "3", "--scaling.num_workers", "2",
              "--scaling.cpus_per_worker", str(CPUS_PER_WORKER), "--model.checkpoint_root", str(checkpoint_root),
              "--run.storage_path", str(tmp_path / "shared"),
              "--tracking.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]

    kills = tmp_path / "kills"
    kills.mkdir()
    (kills / "plan.json").write_text(json.dumps({"event": "train", "step": 3}))
    killed_run = submit(address, env, "stage2", *common, "--run.name", "killed",
                        env_vars={HOOK_ENV: AWAIT_KILL, KILL_DIR_ENV: str(kills)})
    victim = kills / "victim.json"
    deadline = time.time() + 600
    while not victim.exists():
        assert killed_run.poll() is None, killed_run.communicate()[0][-4000:]
        assert time.time() < deadline, "no worker reached train step 3 in 600 s"
        time.sleep(1)
    time.sleep(0.5)  # the pid is written before the worker starts waiting
    os.kill(json.loads(victim.read_text())["pid"], signal.SIGKILL)
    killed = summary_of(killed_run, "stage2")

    workers = [json.loads(p.read_text()) for p in kills.glob("worker-*.json")]
    assert len({w["node"] for w in workers}) == 2, workers  # the workers ran on both nodes
    assert len({w["pid"] for w in workers if w["rank"] == 1}) == 2, workers  # the killed rank came back, a new process

    plain = summary_of(submit(address, env, "stage2", *common, "--run.name", "unkilled"), "stage2")
    assert killed["error"] is None and killed["steps"] == plain["steps"] == 6
    assert killed["examples_seen"] == plain["examples_seen"] == 12
    assert killed["index_checksum"] == plain["index_checksum"]
    assert Path(killed["checkpoint"]).is_relative_to(tmp_path / "shared")

    stage1 = summary_of(submit(address, env, "stage1", *common, "--train.frozen_decoder_steps", "1",
                               "--train.max_steps", "2", "--run.name", "stage1"), "stage1")
    chained = summary_of(submit(address, env, "stage2", *common, "--train.max_steps", "2",
                                "--model.init_from", stage1["export"], "--run.name", "from-stage1"), "stage2")
    assert chained["error"] is None and chained["steps"] == 2
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(chained["mlflow_run_id"])
    assert run.data.tags["init_from"] == str(Path(stage1["export"]).resolve())  # the lineage names stage 1's export
