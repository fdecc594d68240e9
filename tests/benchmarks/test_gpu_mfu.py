"""benchmarks/gpu_mfu.py's packed rows: the layout pipelines.data.packing gives the same examples, and a CPU run
that prints the packed row beside the plain one."""

import subprocess
import sys
from pathlib import Path

import torch

from pipelines.data.packing import PackingSpec, collate_packed, pack_examples

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_mfu import packed  # noqa: E402


def test_packed_rows_are_the_layout_the_corpus_packing_gives_the_same_examples():
    rows, seq, chunks, chunk_len, examples = 2, 12, 6, 4, 3
    ids = torch.randint(5, 100, (rows, seq), generator=torch.Generator().manual_seed(0))
    memory = torch.randint(5, 100, (rows, chunks, chunk_len), generator=torch.Generator().manual_seed(1))
    batch = packed({"input_ids": ids, "memory_input_ids": memory}, examples)
    n, c = seq // examples, chunks // examples
    corpus = [{"input_ids": ids[r, e * n:(e + 1) * n].tolist(), "labels": ids[r, e * n:(e + 1) * n].tolist(),
               "memory_input_ids": memory[r, e * c:(e + 1) * c].tolist()} for r in range(rows) for e in range(examples)]
    spec = PackingSpec(max_tokens=seq, max_chunks=chunks, chunk_len=chunk_len)
    reference = collate_packed(pack_examples(corpus, spec), spec)
    for key in ("input_ids", "segment_ids", "position_ids", "memory_input_ids", "memory_segment_ids"):
        assert torch.equal(batch[key], reference[key]), key


def test_a_cpu_run_times_the_packed_rows_beside_the_plain_ones():
    done = subprocess.run([sys.executable, "benchmarks/gpu_mfu.py", "--device", "cpu", "--pair", "tiny",
                           "--peak-tflops", "0.2", "--seq", "64", "--chunks", "4", "--chunk-len", "16",
                           "--micro-batch", "2", "--repeats", "1", "--warmup", "0", "--no-flop-check", "--packed", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| pair, eager")]
    assert [row.split("|")[1].strip() for row in rows] == ["pair, eager", "pair, eager, 2 examples packed a row"]
