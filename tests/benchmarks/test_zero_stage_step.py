"""benchmarks/zero_stage_step.py: the command it runs is the documented job with the stage and the timing settings
it names, and (slow) a short run prints every stage's row."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from zero_stage_step import job_command  # noqa: E402

READING = ["--model.memory_lexical_gate", "true", "--model.memory_lexical_tokens", "true"]


def test_each_stage_runs_the_job_it_names_with_the_given_flags(tmp_path):
    command = job_command(0, 400, str(tmp_path), "zero0-round0", READING) + ["--dry-run"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    config = yaml.safe_load(done.stdout.split("# resolved config", 1)[1].split("\n#", 1)[0])
    assert config["deepspeed"]["zero_stage"] == 0 and config["needle"]["base_steps"] == 0
    assert config["train"]["max_steps"] == config["train"]["eval_every"] == config["train"]["checkpoint_every"] == 400
    assert config["model"]["memory_lexical_gate"] and config["model"]["memory_lexical_tokens"]
    assert config["tracking"]["enabled"] is False and config["run"]["storage_path"] == str(tmp_path)


@pytest.mark.slow
@pytest.mark.ray
def test_a_short_run_prints_a_row_per_stage():
    done = subprocess.run([sys.executable, "benchmarks/zero_stage_step.py", "--stages", "2", "0", "--steps", "3",
                           "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| 0") or
            line.startswith("| 2")]
    assert [int(r[0]) for r in rows] == [2, 0] and all(float(r[1]) > 0 for r in rows)
