"""summed_over_ranks: the sum over ranks, back on the CPU, the input untouched; and the only all_reduce of pipelines/
(NCCL refuses the CPU tensors metrics are built in: every GPU job's first step failed so, on an H200)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelines.evaluate.collectives import summed_over_ranks

ROOT = Path(__file__).resolve().parents[3]


def _rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        values = torch.tensor([rank + 1.0, 10.0 * rank], dtype=torch.float64)
        summed = summed_over_ranks(values)
        results[rank] = (summed.tolist(), values.tolist(), summed.device.type)
    finally:
        dist.destroy_process_group()


def test_two_ranks_sum_and_keep_their_inputs():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(2, port, results), nprocs=2, join=True)
    assert results[0] == ([3.0, 10.0], [1.0, 0.0], "cpu")
    assert results[1] == ([3.0, 10.0], [2.0, 10.0], "cpu")


def test_pipelines_reduce_only_through_summed_over_ranks():
    raw = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "pipelines").rglob("*.py"))
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"\bdist\.(all_reduce|reduce)\(", line) and path.name != "collectives.py"]
    assert not raw, f"reduce metrics through pipelines.evaluate.collectives.summed_over_ranks: {raw}"
