"""The curriculum's chain: what each step runs, how it passes exports on, resumes, stops at a failure and tags runs.
The whole chain on the tiny pair is the slow test at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines import curriculum
from pipelines.curriculum import CurriculumConfig, link, run_curriculum, steps, tracked_directories

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["corpus0", "corpus2", "stage0", "stage1", "stage2", "teacher", "stage3", "stage4"]


def git_repo(path: Path) -> Path:
    for d in ("src", "docs"):
        (path / d).mkdir(parents=True)
        (path / d / "a.py").write_text("x = 1\n")
    (path / "untracked").mkdir()
    (path / "untracked" / "b.py").write_text("y = 2\n")
    for args in (["init", "-q"], ["add", "src", "docs"],
                 ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start"]):
        subprocess.run(["git", "-C", str(path), *args], check=True)
    return path


def test_stage0_reads_each_tracked_directory_and_nothing_untracked(tmp_path):
    repo = git_repo(tmp_path / "repo")
    assert tracked_directories([str(repo)]) == [str(repo / "docs"), str(repo / "src")]


def test_a_source_without_git_history_is_refused_with_the_fix(tmp_path):
    problems = CurriculumConfig(sources=[str(tmp_path)]).problems()
    assert any("not a git repository" in p and "--sources" in p for p in problems)
    assert CurriculumConfig(memories_per_step=3, num_workers=2, sources=[str(ROOT)]).problems() == [
        "memories_per_step (3) must divide over num_workers (2)"]


def test_each_stage_starts_from_the_export_before_it(tmp_path):
    config = CurriculumConfig(sources=[str(git_repo(tmp_path / "repo"))], out=str(tmp_path / "out"))
    chain = {s.name: s for s in steps(config)}
    assert list(chain) == ORDER
    done = {name: {"export": f"/x/{name}", "accepted": 3} for name in ORDER}

    def flag(name: str, key: str) -> str:
        """A job's command-line flag, or the field of a training step's typed config."""
        if chain[name].config is not None:
            value = chain[name].config(done)
            for part in key.lstrip("-").split("."):
                value = getattr(value, part)
            return value
        args = chain[name].args(done)
        return args[len(args) - 1 - args[::-1].index(key) + 1]

    assert flag("stage0", "--model.init_from") is None
    assert (flag("stage1", "--model.init_from"), flag("stage2", "--model.init_from"),
            flag("stage4", "--model.init_from")) == ("/x/stage0", "/x/stage1", "/x/stage2")
    assert flag("stage3", "--teacher") == flag("stage4", "--distill.teacher") == "/x/teacher"
    assert flag("teacher", "--model.memory") == "in_context"
    assert flag("stage4", "--data.train_path") == str(tmp_path / "out" / "corpus3" / "train")
    done["stage3"]["accepted"] = 0  # nothing verified: stage 4 distils on the stage-2 corpus
    assert flag("stage4", "--data.train_path") == str(tmp_path / "out" / "corpus2" / "train")


def test_a_rerun_skips_finished_steps_and_a_failure_stops_the_chain(tmp_path, monkeypatch):
    config = CurriculumConfig(sources=[str(git_repo(tmp_path / "repo"))], out=str(tmp_path / "out"), register=False)
    ran = []

    def fake_step(step, done, out):
        ran.append(step.name)
        if step.name == "stage1":
            return {"error": "exit status 1: see log"}
        return {"export": f"/x/{step.name}", "rows": {"train": {"commit": 4}}}

    monkeypatch.setattr(curriculum, "run_step", fake_step)
    monkeypatch.setattr(curriculum, "link", lambda *a: {"run_id": ""})
    summary = run_curriculum(config, progress=lambda line: None)
    assert ran == ["corpus0", "corpus2", "stage0", "stage1"]
    assert summary["failed"] == "stage1" and summary["done"] == ["corpus0", "corpus2", "stage0"]
    ran.clear()
    monkeypatch.setattr(curriculum, "run_step", lambda step, done, out: ran.append(step.name) or {
        "export": f"/x/{step.name}", "accepted": 2})
    summary = run_curriculum(config, progress=lambda line: None)
    assert ran == ORDER[3:] and summary["error"] is None  # the first three were not run again
    assert summary["stage4_data"] == "stage-3 accepted rows"


def test_a_stage_run_is_tagged_with_the_run_it_started_from(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)  # not mlflow.set_tracking_uri: the process-wide URI stays the other tests'
    experiment = client.create_experiment("curriculum")
    ids = {name: client.create_run(experiment, run_name=name).info.run_id for name in ("stage1", "stage2")}
    config = CurriculumConfig(tracking_uri=uri, register=False, out=str(tmp_path / "out"))
    first = link(config, "stage1", {"mlflow_run_id": ids["stage1"]}, {})
    done = {"stage1": {"curriculum": first}}
    link(config, "stage2", {"mlflow_run_id": ids["stage2"]}, done)
    tags = MlflowClient(uri).get_run(ids["stage2"]).data.tags
    assert tags["curriculum.previous_run_id"] == ids["stage1"] and tags["curriculum.step"] == "stage2"
    assert "curriculum.previous_run_id" not in MlflowClient(uri).get_run(ids["stage1"]).data.tags


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(3600)
def test_the_curriculum_runs_end_to_end_on_the_tiny_pair(tmp_path, checkpoint_root):
    """Stages 0 -> 4 on this repository, a few steps each; every stage's version tagged with the one before."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "curriculum.py"), "--out", str(tmp_path / "c"), "--steps", "2",
         "--teacher_steps", "2", "--attempts", "2", "--stage3_rows", "2", "--tracking_uri", uri,
         "--checkpoint_root", str(checkpoint_root)],
        capture_output=True, text=True, timeout=3500, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["error"] is None and set(ORDER) <= set(summary)
    assert summary["stage4"]["kl_first"] is not None
    client = MlflowClient(uri)
    versions = {v.tags["curriculum.step"]: v for v in client.search_model_versions("name='awareness-curriculum'")}
    assert versions["stage2"].tags["curriculum.previous_version"] == versions["stage1"].version
    assert versions["stage4"].tags["curriculum.previous_version"] == versions["stage2"].version
