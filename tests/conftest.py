"""Shared fixtures: tiny random Qwen3 / Qwen3-MoE checkpoints written with save_pretrained (never downloaded)."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s and starts a spot-preemption watcher (an actor) for every run:
# on a one-node test cluster the poll only delays the end of each run, and no node is ever preempted. Polled every
# 0.5 s, without the watcher: ~5 s less a run, measured side by side (2 cores). Jobs that tests start inherit both.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

import pytest
import torch

from models import PAIRS, AwarenessModel, build_pair, write_random_checkpoints


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    write_random_checkpoints(PAIRS["tiny"], root)
    write_random_checkpoints(PAIRS["tiny-moe"], root)
    return root


@pytest.fixture
def tiny(checkpoint_root) -> AwarenessModel:
    torch.manual_seed(0)
    return build_pair("tiny", checkpoint_root=checkpoint_root).eval()


@pytest.fixture
def tiny_moe(checkpoint_root) -> AwarenessModel:
    torch.manual_seed(0)
    return build_pair("tiny-moe", checkpoint_root=checkpoint_root).eval()


def open_gates(model: AwarenessModel, value: float = 0.7) -> AwarenessModel:
    """Sets every GCA gate non-zero, so the memory matters."""
    model.set_gates(value)
    return model


def random_ids(*shape: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# Where a `gpu` test runs: CUDA, else skipped. AWARENESS_GPU_TESTS_ON_CPU=1 runs them on the CPU instead, a dry run of
# the tests' own code (kernels the CPU lacks skip): it checks the tests, not the GPU.
GPU_TESTS_ON_CPU = "AWARENESS_GPU_TESTS_ON_CPU"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or os.environ.get(GPU_TESTS_ON_CPU) == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs the gpu tests on a GPU box)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
