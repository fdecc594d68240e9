"""benchmarks/memory_routing.py as documented, with the stage-0 preset's reading (k = 2, router-mixed chunks, the
question's lexical prior): it prints one table row per memory size, full attention beside routing."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_run_prints_a_row_per_size_for_the_presets_reading():
    done = subprocess.run([sys.executable, "benchmarks/memory_routing.py", "--quick", "--top-k", "2", "--chunk-weights",
                           "router", "--lexical", "1", "--chunk-len", "24", "--threads", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "chunk weights router, lexical prior 1.0" in done.stdout
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("|") and "---" not in line]
    assert [int(r[0].replace(",", "")) for r in rows[1:]] == [1008, 4080]  # whole chunks of 24 tokens
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows[1:])
