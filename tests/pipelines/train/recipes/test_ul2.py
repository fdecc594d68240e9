"""The UL2 job end to end through Ray Train + DeepSpeed ZeRO-3 on 2 CPU workers: the loss falls, the exports reload,
the encoder serves Awareness; its config errors are collected and name the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelines.cli import parse_config
from pipelines.data.ul2 import Ul2DataConfig, source_files
from pipelines.format.tokenizer import load_tokenizer
from pipelines.train.configs.ul2 import Ul2Config

ROOT = Path(__file__).resolve().parents[4]


def test_config_errors_are_collected_and_name_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--data.mixture", "bert", "--model.encoder_key_rope", "alibi",
                      "--model.checkpoint", str(tmp_path / "nope")], Ul2Config())
    lines = capsys.readouterr().err.splitlines()
    for expected, line in zip(("encoder_key_rope", "is not a directory", "data.mixture"), lines, strict=True):
        assert expected in line  # one line per problem
    with pytest.raises(FileNotFoundError, match="does not exist"):
        source_files(Ul2DataConfig(paths=[str(tmp_path / "missing")]))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path, 512)


@pytest.mark.ray
@pytest.mark.slow  # ~100 s; `make test` keeps UL2's data, config and model tests (tests/pipelines/data/test_ul2.py)
def test_encoder_ul2_job_through_ray_train(tmp_path, checkpoint_root):
    """A few steps of the job as a user runs it (Ray Train, ZeRO-3 over gloo on 2 CPU workers, MLflow): the loss
    falls, the exported seq2seq model and encoder reload, and the encoder serves as the Awareness memory encoder."""
    from models import Qwen3EncoderModel, Qwen3ForSeq2SeqLM, build_pair

    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "encoder_ul2.py"), "--train.max_steps", "8", "--train.log_every", "1",
         "--train.checkpoint_every", "8", "--train.memories_per_step", "8", "--train.warmup_steps", "2",
         "--data.seq_len", "64", "--data.mixture", "span", "--data.paths", str(ROOT / "models"),
         "--model.checkpoint_root", str(tmp_path / "ckpt"), "--run.storage_path", str(tmp_path / "ray")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 8 and summary["error"] is None and summary["mlflow_run_id"]
    assert summary["loss_last"] < summary["loss_first"] - 0.2, summary  # 8 steps: ~5.7 -> ~5.3 (ln 512 = 6.2)
    assert (tmp_path / "mlflow.db").is_file()
    seq2seq = Qwen3ForSeq2SeqLM.from_pretrained(summary["seq2seq"]).eval()
    encoder = Qwen3EncoderModel.from_pretrained(summary["encoder"]).eval()
    tok = load_tokenizer(summary["encoder"], 512)
    ids = torch.tensor([tok.encode("def forward(self, x):").ids])
    with torch.no_grad():
        want = seq2seq.encoder(input_ids=ids).last_hidden_state
        torch.testing.assert_close(encoder(input_ids=ids).last_hidden_state, want)
        assert seq2seq.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 5)
    aware = build_pair("tiny", checkpoint_root=checkpoint_root, encoder_checkpoint=summary["encoder"]).eval()
    with torch.no_grad():
        states, _ = aware.memory_encoder(ids)
    torch.testing.assert_close(states, want, atol=1e-5, rtol=1e-5)
