"""The entry points run end to end as a user runs them, and end with a parseable one-line JSON summary."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_job(*args: str, cwd: Path, env_root: Path) -> dict:
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "generate.py"), "--checkpoint-root", str(env_root), *args],
        cwd=cwd, capture_output=True, text=True, timeout=300, check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generate_job_closed_then_open_gates(checkpoint_root, tmp_path):
    closed = run_job("--max-new-tokens", "6", cwd=tmp_path, env_root=checkpoint_root)
    assert closed["gates"] == [0.0] and closed["matches_no_memory"] and not closed["memory_changes_output"]
    assert closed["max_logit_change"] == 0.0
    opened = run_job("--gate", "1.5", "--memories", "4", "--max-new-tokens", "12", "--num-beams", "2",
                     cwd=tmp_path, env_root=checkpoint_root)
    # Open gates: the memory moves the next-token logits. (Whether greedy tokens also change depends on how peaked
    # a random model's logits happen to be, so that is reported, not asserted.)
    assert opened["gates"][0] > 0.9 and opened["max_logit_change"] > 1e-3
    assert isinstance(opened["memory_changes_output"], bool)
