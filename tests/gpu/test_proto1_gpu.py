"""proto1 (Qwen3-0.6B + Qwen3-Embedding-0.6B: random weights of the real architecture, written as bf16 checkpoints)
built the way a stage job builds it, inside DeepSpeed's zero.Init (ZeRO-3, bf16) on one GPU, then trained a few steps
with the pipeline's own step (pipelines.train.loop.train_step: DeepSpeed's backward and step, the loss all-reduced);
its peak GPU memory, loading and training, against jobs/plan.py's prediction for the same run, within 15%.

Measured peak = the CUDA caching allocator's peak reservation in the phase plus what the device holds outside it (CUDA
context, NCCL: the device's used memory minus the allocator's reservation), the quantity the plan predicts. The
measured and predicted tables are printed (pytest -s) for docs/benchmarks.md.

The shapes: a stage-2 run of corpus rows of 2048 decoder tokens and 16 x 512 memory tokens, 4 per step, decoder
LoRA r16, GCA and projection trained, gradient checkpointing on (the plan's default). One rank, spawned
(tests/pipelines/train/one_rank.py). AWARENESS_GPU_TESTS_PAIR=small runs it with the small pair (the CPU dry run)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from models import PAIRS, write_random_checkpoints
from pipelines.corpora.random_rows import write_random_corpus
from pipelines.train.configs.common import DeepSpeedSettings, ScalingSettings, TrainConfig
from pipelines.train.configs.stage import DataConfig, ModelConfig, StageConfig
from pipelines.train.plan import GIB, plan_for_stage
from tests.pipelines.train.one_rank import run_one_rank

pytestmark = pytest.mark.gpu

PAIR = os.environ.get("AWARENESS_GPU_TESTS_PAIR", "proto1")
STEPS, MEMORIES, MAX_TOKENS, CHUNKS, CHUNK_LEN = 4, 4, 2048, 16, 512
PLAN_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def run_config(tmp_path_factory, device) -> StageConfig:
    root = tmp_path_factory.mktemp("proto1")
    checkpoints = os.environ.get("AWARENESS_GPU_CHECKPOINTS", str(root / "checkpoints"))  # gpu_check.py shares them
    write_random_checkpoints(PAIRS[PAIR], checkpoints, dtype=torch.bfloat16)
    vocab = min(PAIRS[PAIR].decoder_config["vocab_size"], PAIRS[PAIR].encoder_config["vocab_size"])
    split = write_random_corpus(root / "corpus", rows=2 * MEMORIES, max_tokens=MAX_TOKENS, chunks=CHUNKS,
                                chunk_len=CHUNK_LEN, vocab=vocab)
    cuda = device.type == "cuda"
    total_gib = torch.cuda.get_device_properties(device).total_memory / GIB if cuda else 80.0
    return StageConfig(
        stage=2,
        model=ModelConfig(pair=PAIR, checkpoint_root=checkpoints, decoder="lora", encoder="frozen",
                          gradient_checkpointing=True),
        data=DataConfig(train_path=str(split), max_tokens=MAX_TOKENS, max_chunks=CHUNKS, chunk_len=CHUNK_LEN,
                        verify_hashes=False),
        train=TrainConfig(max_steps=STEPS, memories_per_step=MEMORIES, lr=1e-4, warmup_steps=1),
        scaling=ScalingSettings(num_workers=1, use_gpu=cuda, gpus_per_node=1, gpu_memory_gib=total_gib),
        deepspeed=DeepSpeedSettings(zero_stage=3, precision="bf16"),
    )


@pytest.fixture(scope="module")
def measured(run_config, tmp_path_factory) -> dict:
    return run_one_rank(run_config, tmp_path_factory.mktemp("measured") / "rank0.json")


def test_proto1_trains_with_the_pipelines_step_in_bf16_under_zero3(measured):
    print(f"{PAIR}: losses {measured['losses']}, gradient norms {measured['grad_norms']}, "
          f"step seconds {measured['step_seconds']}")
    assert measured["steps"] == STEPS
    assert measured["dtypes"] == ["torch.bfloat16"]  # DeepSpeed's bf16: fp32 only in the optimizer's master copies
    assert all(math.isfinite(x) for x in measured["losses"] + measured["grad_norms"])
    assert all(n > 0 for n in measured["grad_norms"])


def test_proto1_peak_memory_matches_the_plan(measured, run_config, device):
    plan = plan_for_stage(run_config)
    print(plan.table())
    phases = {"loading": plan.load_gib, "training": plan.total_gib}
    for phase, predicted in phases.items():
        print(f"{phase}: measured {measured[phase]} GiB, plan {predicted:.2f} GiB")
    if device.type != "cuda":
        pytest.skip("GPU memory is measured on CUDA only")
    for phase, predicted in phases.items():
        peak = measured[phase]["peak"]
        assert abs(predicted - peak) <= PLAN_TOLERANCE * peak, (phase, predicted, peak)
