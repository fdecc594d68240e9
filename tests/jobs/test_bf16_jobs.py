"""The stage jobs with --deepspeed.precision bf16 through Ray Train + DeepSpeed on 2 CPU workers, as a user runs
them: stage 0 (ZeRO-3, the default) beside the same run in fp32, step by step, and stage 2 (ZeRO-2) on a corpus of
random rows, whose export reloads in bf16 and in fp32."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import AwarenessModel
from pipelines.corpora.random_rows import write_random_corpus

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ~70-90 s a job on the shared 2 cores

ROOT = Path(__file__).resolve().parents[2]
STEP_LOSS = re.compile(r"^step (\d+)/\d+  loss ([0-9.]+)")
LOSS_TOLERANCE = 0.05  # nats, at every step (tests/pipelines/train/test_bf16.py measures 0.004 over 20 steps)


def run(job: str, *args: str, cwd: Path) -> tuple[dict, dict[int, float]]:
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / f"{job}.py"), *args], cwd=cwd, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    losses = {int(m[1]): float(m[2]) for line in result.stdout.splitlines() if (m := STEP_LOSS.match(line))}
    return json.loads(result.stdout.strip().splitlines()[-1]), losses


def test_stage0_job_in_bf16_tracks_fp32(tmp_path, checkpoint_root):
    common = ["--train.max_steps", "4", "--train.log_every", "1", "--train.eval_every", "4",
              "--train.checkpoint_every", "4", "--needle.val_memories", "8", "--model.checkpoint_root",
              str(checkpoint_root), "--run.storage_path", str(tmp_path / "ray"), "--tracking.enabled", "false"]
    runs = {p: run("stage0", *common, "--deepspeed.precision", p, "--run.name", p, cwd=tmp_path)
            for p in ("fp32", "bf16")}
    (_, fp32), (bf16_summary, bf16) = runs["fp32"], runs["bf16"]
    print(f"stage 0, 2 workers, ZeRO-3, step losses: fp32 {fp32}, bf16 {bf16}")
    assert bf16_summary["error"] is None and bf16_summary["steps"] == 4 and sorted(bf16) == [1, 2, 3, 4]
    assert max(abs(fp32[s] - bf16[s]) for s in fp32) < LOSS_TOLERANCE


def test_stage2_job_in_bf16_with_zero2_and_its_export_reloads_in_either_dtype(tmp_path):
    split = write_random_corpus(tmp_path / "corpus", rows=16, val_rows=4, max_tokens=64, chunks=2, chunk_len=32,
                                vocab=151669)
    summary, losses = run(
        "stage2", "--data.train_path", str(split), "--data.val_path", str(split.parent / "val"),
        "--data.max_tokens", "64", "--data.max_chunks", "2", "--data.chunk_len", "32", "--data.val_examples", "4",
        "--train.max_steps", "2", "--train.memories_per_step", "4", "--train.log_every", "1",
        "--train.eval_every", "2", "--train.checkpoint_every", "2", "--deepspeed.precision", "bf16",
        "--deepspeed.zero_stage", "2", "--run.storage_path", str(tmp_path / "ray"), "--tracking.enabled", "false",
        cwd=tmp_path)
    print(f"stage 2, 2 workers, ZeRO-2, bf16: step losses {losses}, val_loss {summary['val_loss']}")
    assert summary["error"] is None and summary["steps"] == 2 and summary["val_loss"] > 0
    for dtype in (torch.bfloat16, torch.float32):
        model = AwarenessModel.from_pretrained(summary["export"], dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}
