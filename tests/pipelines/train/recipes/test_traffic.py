"""The traffic VLM job's parts without Ray: config errors collected with their fixes, --dry-run and a wrong flag as a
user meets them. Its batches: tests/pipelines/data/test_traffic_batches.py; its metrics:
tests/pipelines/evaluate/test_traffic.py; its figures: tests/pipelines/evaluate/test_plots.py. The job through Ray
Train is tests/jobs/test_traffic_vlm_job.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import parse_config
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.presets import TRAFFIC_VLM

ROOT = Path(__file__).resolve().parents[4]


def test_config_errors_are_collected_and_name_the_fix(tmp_path, capsys):
    (tmp_path / "siglip").mkdir()
    (tmp_path / "siglip" / "config.json").write_text(json.dumps({"vision_config": {"image_size": 384}}))
    with pytest.raises(SystemExit) as exit:
        parse_config(["--model.image_size", "100", "--data.question_types", "light_red", "flying_cars",
                      "--train.memories_per_step", "33", "--model.vocab_size", "50", "--model.kv_heads", "3"],
                     TrafficConfig())
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    for expected, line in zip(("multiple of model.patch_size", "multiple of model.kv_heads", "vocab_size (50)",
                               "['flying_cars']", "divide evenly"), lines, strict=True):
        assert expected in line, line  # one line per problem
    problems = TrafficConfig.from_dict({"model": {"vision_path": str(tmp_path / "siglip")}}).problems()
    assert problems == ["model.image_size (224) differs from the checkpoint's image_size (384): pass "
                        "--model.image_size 384"]
    assert "holds no config.json" in TrafficConfig.from_dict({"model": {"vision_path": str(tmp_path)}}).problems()[0]
    assert TRAFFIC_VLM.problems() == []


def test_dry_run_help_and_a_wrong_flag_as_processes(tmp_path):
    """As a user runs them: --dry-run prints the resolved config and the model's shape without Ray; a wrong flag is
    one line and exit 2; --help shows the fields' docs."""
    job = [sys.executable, str(ROOT / "jobs" / "traffic_vlm.py")]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    started = [subprocess.Popen([*job, *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
               for args in (["--dry-run"], ["--train.max_step", "5"], ["--help"])]
    (dry, _), (_, wrong), (help_text, _) = (p.communicate(timeout=300) for p in started)
    assert [p.returncode for p in started] == [0, 2, 0]
    assert dry.startswith("# resolved config") and f"storage_path: {tmp_path / 'outputs' / 'ray'}" in dry
    assert "vision tokens: 196 (224/16 squared" in dry and "decoder 18.16M" in dry
    assert not (tmp_path / "outputs").exists()
    assert wrong.strip() == "traffic_vlm.py: unknown config key 'train.max_step'; did you mean --train.max_steps?"
    for doc in ("--data.train_scenes", "the first N seeds of the train split", "--model.vision_path", "--dry-run"):
        assert doc in help_text, doc
