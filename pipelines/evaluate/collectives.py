"""Metrics summed over the ranks of a training run (the step's loss and token counts, in-training evaluation)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def summed_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over every rank, returned on the CPU where metrics are built. NCCL reduces only CUDA tensors
    ("No backend type associated with device type cpu": every GPU job's first step failed so, on an H200,
    2026-11-26), so under NCCL the sum runs on this rank's GPU; under gloo on the CPU."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else values.device
    reduced = values.to(device, copy=True)  # `values` is left as it was
    dist.all_reduce(reduced)
    return reduced.cpu()
