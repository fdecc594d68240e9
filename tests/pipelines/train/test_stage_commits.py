"""Stages 1 and 2 end to end on real shards: a git history -> jobs/build_corpus.py's commit corpus -> jobs/stage1.py
and jobs/stage2.py on the tiny-text pair (Qwen3's vocabulary) through the sharded reader, packing and ZeRO-3 on 2
workers; stage 2's export reloads outside DeepSpeed to the validation loss the job reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from models import AwarenessModel
from pipelines.data.packing import PackingSpec
from pipelines.data.streams import validation_rows
from pipelines.evaluate.in_training import evaluate_corpus
from tests.pipelines.corpora.test_commits import body, commit, sh

ROOT = Path(__file__).resolve().parents[3]


def build_commit_corpus(tmp_path: Path) -> Path:
    """A 5-commit git history made here -> jobs/build_corpus.py --stage 2 -> the split it wrote (one repository is
    held out whole, so the corpus has train or val, not both): tests train and validate on it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    sh(repo, "init", "-q")
    commit(repo, "start", {"a.py": body(5), "b.py": body(3, "b")})
    for n in range(6, 10):
        commit(repo, f"Grow a.py to {n} functions", {"a.py": body(n)})
    build = subprocess.run([sys.executable, str(ROOT / "jobs" / "build_corpus.py"), "--stage", "2", "--sources",
                            str(repo), "--out", str(tmp_path / "corpus"), "--num_cpus", "1"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    return next(tmp_path / "corpus" / s for s in ("train", "val") if (tmp_path / "corpus" / s).is_dir())


@pytest.mark.ray
@pytest.mark.slow  # ~70 s
def test_stage1_trains_on_a_built_commit_corpus(tmp_path, checkpoint_root):
    split = build_commit_corpus(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = pq.read_table(split).to_pylist()
    assert {r["variant"] for r in rows} >= {"hinted", "imperative"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "stage1.py"), "--data.train_path", str(split),
         "--data.val_path", str(split), "--data.max_tokens", "1024", "--data.max_chunks", "4",
         "--data.val_examples", "4", "--train.max_steps", "2", "--train.memories_per_step", "2",
         "--train.frozen_decoder_steps", "1", "--train.eval_every", "2", "--train.checkpoint_every", "2",
         "--train.log_every", "1", "--model.checkpoint_root", str(checkpoint_root),
         "--run.storage_path", str(tmp_path / "ray")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["job"] == "stage1" and summary["steps"] == 2 and summary["error"] is None
    assert summary["val_loss"] > 0 and summary["no_memory_val_loss"] > 0
    assert (Path(summary["export"]) / "awareness.safetensors").is_file()


@pytest.mark.ray
@pytest.mark.slow  # ~120 s; make test-e2e keeps corpus-fed training, resume and validation (test_corpus_training.py)
def test_stage2_trains_with_zero3_and_its_export_reloads_to_the_same_val_loss(tmp_path, checkpoint_root):
    split = build_commit_corpus(tmp_path)
    variants = pq.read_table(split, columns=["variant"]).column("variant").to_pylist()
    assert set(variants) >= {"planning", "raw"}
    rows = len(variants)
    shapes = {"max_tokens": 1024, "max_chunks": 4, "chunk_len": 512}
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "stage2.py"), "--data.train_path", str(split),
         "--data.val_path", str(split), *[a for k, v in shapes.items() for a in (f"--data.{k}", str(v))],
         "--data.val_examples", str(rows), "--train.max_steps", "2", "--train.memories_per_step", "2",
         "--train.eval_every", "2", "--train.checkpoint_every", "2", "--train.log_every", "1",
         "--deepspeed.zero_stage", "3", "--scaling.num_workers", "2",
         "--model.checkpoint_root", str(checkpoint_root), "--run.storage_path", str(tmp_path / "ray")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["job"] == "stage2" and summary["steps"] == 2 and summary["error"] is None
    model = AwarenessModel.from_pretrained(summary["export"])
    reloaded = evaluate_corpus(model, validation_rows(str(split), None, rows), PackingSpec(**shapes, pad_id=0))
    assert reloaded["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-4)
    assert reloaded["no_memory_val_loss"] == pytest.approx(summary["no_memory_val_loss"], rel=1e-4)
