"""The GPU tests' device: CUDA (tests/conftest.py skips every `gpu` test without it), or the CPU when
AWARENESS_GPU_TESTS_ON_CPU=1 asks for a dry run of the tests' own code."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64: one number for a whole tensor, whatever its scale."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))
