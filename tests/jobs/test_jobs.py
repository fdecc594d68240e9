"""The entry points run end to end as a user runs them, and end with a parseable one-line JSON summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_job(*args: str, cwd: Path, env_root: Path) -> dict:
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "generate.py"), "--checkpoint_root", str(env_root), *args],
        cwd=cwd, capture_output=True, text=True, timeout=300, check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~75 s; the gate invariants it shows are tested on the model in tests/models (fast)
def test_generate_job_closed_then_open_gates(checkpoint_root, tmp_path):
    closed = run_job("--max_new_tokens", "6", cwd=tmp_path, env_root=checkpoint_root)
    assert closed["gates"] == [0.0] and closed["matches_no_memory"] and not closed["memory_changes_output"]
    assert closed["max_logit_change"] == 0.0
    opened = run_job("--gate", "1.5", "--memories", "4", "--max_new_tokens", "12", "--num_beams", "2",
                     cwd=tmp_path, env_root=checkpoint_root)
    # Open gates: the memory moves the next-token logits. (Whether greedy tokens also change depends on how peaked
    # a random model's logits happen to be, so that is reported, not asserted.)
    assert opened["gates"][0] > 0.9 and opened["max_logit_change"] > 1e-3
    assert isinstance(opened["memory_changes_output"], bool)


def start_job(name: str, *args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "jobs" / f"{name}.py"), *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})


def finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def job(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return finish(start_job(name, *args, cwd=cwd))


def user_lines(stderr: str) -> list[str]:
    """stderr without third-party import chatter (MLflow's database set-up, warnings)."""
    return [line for line in stderr.splitlines() if line.startswith(("stage", "sweep", "register", "build", "plan",
                                                                     "generate", "encoder"))]


def test_a_wrong_value_or_unknown_key_is_one_line_and_exit_2(tmp_path):
    started = [start_job("stage0", "--train.max_steps", "abc", cwd=tmp_path),  # side by side: each pays the imports
               start_job("stage0", "--train.max_step", "5", cwd=tmp_path)]
    wrong, unknown = map(finish, started)
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1 and "train.max_steps" in wrong.stderr
    assert unknown.returncode == 2 and "did you mean --train.max_steps?" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1


def test_register_with_an_unknown_run_is_one_line_and_exit_2(tmp_path):
    result = job("register", "--run_id", "deadbeef", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert user_lines(result.stderr) == ["register.py: Run with id=deadbeef not found"]


def test_register_step_needs_a_run(tmp_path):
    result = job("register", "--promote", "3", "--step", "200", cwd=tmp_path)
    assert result.returncode == 2 and "--step picks a checkpoint of --run_id RUN_ID" in result.stderr


def test_help_shows_each_fields_doc(tmp_path):
    result = job("stage2", "--help", cwd=tmp_path)
    assert result.returncode == 0
    for doc in ("--train.memories_per_step", "global batch, in memories", "a name from models.PAIRS",
                "prompt variants to keep", "--dry-run"):
        assert doc in result.stdout, doc


def test_stage2_dry_run_prints_the_plan_without_ray(tmp_path):
    for split in ("train", "val"):
        (tmp_path / "C" / split).mkdir(parents=True)
    result = job("stage2", "--dry-run", "--data.train_path", "C/train", "--data.val_path", "C/val", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"train_path: {tmp_path / 'C' / 'train'}" in result.stdout  # resolved
    assert "# memory plan" in result.stdout and "fits:" in result.stdout
    assert not (tmp_path / "outputs").exists() and "Started a local Ray" not in result.stderr
