"""The dense retriever job (jobs/retriever.py) end to end through Ray Train + DeepSpeed on 2 CPU workers: it learns
to find a question's evidence chunk, an alias question's too (no token shared), and its export is what a dense_rag
reader reads with; its config errors are collected and name the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import parse_config
from pipelines.data.memory_modes import MemoryMode, chunks_in_prompt_each
from pipelines.evaluate.needle import make_probe
from pipelines.train.configs.retriever import RetrieverConfig

ROOT = Path(__file__).resolve().parents[4]


def test_config_errors_are_collected_and_name_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--model.pair", "huge", "--model.temperature", "0", "--model.encoder_checkpoint",
                      str(tmp_path / "nope"), "--needle.base_steps", "100", "--needle.base_until", "0.9"],
                     RetrieverConfig())
    lines = capsys.readouterr().err.splitlines()
    for expected, line in zip(("model.pair", "temperature", "is not a directory", "needle.base_until reads"), lines,
                              strict=True):
        assert expected in line  # one line per problem


@pytest.mark.ray
def test_retriever_job_learns_the_evidence_and_exports_a_dense_rag_retriever(tmp_path):
    """alias questions alone, one chunk retrieved of 16 (4x memories, two of whose chunks hold facts: a retriever that
    only told facts from filler would find 0.5): the held-out recall shows the alias table learned, and the export,
    read as a dense_rag memory, puts a probe question's evidence chunk in the prompt as often."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "retriever.py"), "--needle.variants", "alias", "--needle.base_steps", "0",
         "--model.k", "1", "--train.max_steps", "400", "--train.eval_every", "400", "--train.checkpoint_every", "400",
         "--model.checkpoint_root", str(tmp_path / "ckpt"), "--run.storage_path", str(tmp_path / "ray")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 400 and summary["error"] is None and summary["mlflow_run_id"]
    assert summary["loss_last"] < summary["loss_first"] / 2, summary
    recall = summary["recall_at_1"]
    assert recall["alias"] >= 0.8, recall
    mode = MemoryMode("dense_rag", rag_k=1, retriever=summary["retriever"])
    assert mode.problems() == []
    spec = RetrieverConfig().needle.spec()
    found = []
    for index in range(8):
        probe = make_probe("alias", spec, 4, seed=7, index=index)
        kept = chunks_in_prompt_each(probe.memory.tolist(), probe.questions, mode)
        found += [set(evidence) <= set(top) for evidence, top in zip(probe.evidence, kept, strict=True)]
    assert sum(found) / len(found) >= 0.8, found
