"""benchmarks/routed_training.py as documented: the stage-0 preset's training step per memory size, the read that
attends every chunk beside the gathered one and the one `auto` takes."""

import subprocess
import sys
from pathlib import Path

from models.gca import ROUTER_GATHERS_FROM_CHUNKS_PER_K

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_prints_each_path_for_two_memory_sizes():
    done = subprocess.run([sys.executable, "benchmarks/routed_training.py", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the stage-0 preset (top-2 of chunks of 24, router-weighted)" in done.stdout
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("|") and "---" not in line]
    chunks = [int(r[0]) for r in rows[1:]]
    assert len(chunks) == 2 and all(c % 4 == 0 for c in chunks)  # whole base memories of 4 chunks
    assert all(float(x) > 0 for r in rows[1:] for x in r[1:5])
    picks = {int(r[0]): r[5].strip() for r in rows[1:]}
    assert picks == {c: "gathered" if c >= ROUTER_GATHERS_FROM_CHUNKS_PER_K * 2 else "every chunk" for c in chunks}
