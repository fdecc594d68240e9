"""A stage job checks its corpus shards before any cluster time: a truncated shard of a corpus (its manifest as
jobs/build_corpus.py writes it), or a corpus whose manifest predates shard records, is refused in seconds with the path
and the fix, exit status 2, the JSON summary as the last line, and no MLflow run opened."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ray

from tests.pipelines.format.test_shards import write_split
from tests.pipelines.train.test_corpus_training import corpus_rows

ROOT = Path(__file__).resolve().parents[3]


def stage1(split: Path | None, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    """jobs/stage1.py on `split` (None: --help) and its wall seconds."""
    args = ["--help"] if split is None else [
        "--data.train_path", str(split), "--data.val_path", str(split), "--train.max_steps", "2",
        "--train.memories_per_step", "2", "--run.storage_path", str(tmp_path / "ray"),
        "--tracking.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / "stage1.py"), *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return result, time.perf_counter() - started


def no_run_opened(tmp_path: Path) -> bool:
    if not (tmp_path / "mlflow.db").exists():
        return True
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return not [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


def test_a_truncated_shard_is_refused_before_ray_and_mlflow(tmp_path):
    split = write_split(tmp_path / "corpus", corpus_rows(12, seed=0), files=2, row_group_rows=4)  # with shard records
    shard = sorted(split.glob("*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[:200])
    result, seconds = stage1(split, tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{shard}: 200 bytes, the manifest says" in result.stderr
    assert "rebuild the corpus: python jobs/build_corpus.py --stage 2 --sources" in result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["job"] == "stage1" and summary["error"] and summary["bad_shards"][0].startswith(str(shard))
    assert "Traceback" not in result.stderr and "Ray" not in result.stderr and no_run_opened(tmp_path)
    _, help_seconds = stage1(None, tmp_path)  # the job's imports and parsing alone
    assert seconds < 2 * help_seconds + 10, (seconds, help_seconds)  # about as long (generous: the cores are shared)
    print(f"refused in {seconds:.1f} s (--help: {help_seconds:.1f} s)")

    manifest_file = split.parent / "manifest.json"  # a corpus built before shard records
    manifest = json.loads(manifest_file.read_text())
    manifest.pop("shards")
    manifest_file.write_text(json.dumps(manifest))
    result, _ = stage1(split, tmp_path)
    assert result.returncode == 2 and "written by an older jobs/build_corpus.py" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["error"] and no_run_opened(tmp_path)


def test_a_rerun_with_another_config_is_refused_before_ray(tmp_path, capsys):
    """The same run.name and storage path resume the run, so a rerun whose model, data or optimizer differ would
    train on from (or return) the old run's checkpoint as the new job's: it is refused, naming each changed field."""
    from pipelines.train.driver import CONFIG_FILE, config_fields
    from pipelines.train.job import run_job
    from pipelines.train.presets import STAGE0

    where = ["--run.storage_path", str(tmp_path / "ray"), "--run.name", "rerun"]
    recorded = dataclasses.replace(STAGE0, run=dataclasses.replace(STAGE0.run, storage_path=str(tmp_path / "ray"),
                                                                   name="rerun"))
    (tmp_path / "ray" / "rerun").mkdir(parents=True)
    (tmp_path / "ray" / "rerun" / CONFIG_FILE).write_text(json.dumps(config_fields(recorded)))
    code = run_job([*where, "--train.lr", "1e-3", "--model.lora_rank", "4", "--train.max_steps", "5"], STAGE0, "")
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert "train.lr 0.002 -> 0.001" in err and "model.lora_rank 16 -> 4" in err, err
    assert "max_steps" not in err  # a resume may run longer
    assert "another --run.name" in err and err.startswith("stage0: run.name 'rerun'")
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["job"] == "stage0" and "train.lr" in summary["error"]
    assert not ray.is_initialized(), "the refusal must come before Ray starts"


def test_the_loop_config_unpickles_without_torch(tmp_path):
    """Ray Train's controller unpickles the loop config before any worker starts: if it held the recipe object, the
    controller would import torch, DeepSpeed and transformers first (~9 s a run on 2 cores). It names the recipe,
    and the name gives the workers the same recipe."""
    import pickle

    from pipelines.train.driver import loop_config
    from pipelines.train.loop import recipe_from
    from pipelines.train.presets import STAGE0
    from pipelines.train.recipes import Prepared
    from pipelines.train.recipes.jobs import JOBS

    for recipe in (job.recipe() for job in JOBS.values()):
        data = pickle.dumps(loop_config(recipe, Prepared(STAGE0), "sqlite:///x.db", "run", tmp_path))
        assert type(recipe_from(pickle.loads(data)["recipe"])) is type(recipe)
        probe = ("import pickle, sys; pickle.loads(sys.stdin.buffer.read()); "
                 "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
        result = subprocess.run([sys.executable, "-c", probe], input=data, capture_output=True, timeout=120,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert result.returncode == 0 and result.stdout.decode().strip() == "[]", (recipe, result)
