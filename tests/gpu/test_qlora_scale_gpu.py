"""The scale pair (Qwen3-8B + Qwen3-Embedding-8B: random weights of the real architecture, bf16 checkpoints) under
QLoRA on one GPU, as the seed's plan trains it on an A100-40G: NF4 base weights, 8-bit AdamW, the ZeRO stage the
memory plan chooses for a 40 GiB card, trained a few steps with the pipeline's own step. Its peak against
jobs/plan.py's prediction (15%) and against 40 GiB; then the same run with a bf16 base and torch's AdamW on the
whole card, for the tokens/s side by side (printed: pytest -s) and its own peak against its plan.

The shapes are the plan's defaults: micro-batch 1 of 4096 decoder tokens reading 32 x 512 memory tokens, decoder
LoRA r16, GCA and projection trained, gradient checkpointing on. One rank, spawned (tests/pipelines/train/one_rank.py).
AWARENESS_GPU_TESTS_QLORA_PAIR=tiny runs it on the CPU with bitsandbytes' CPU backend and small shapes (the dry run
of the test's own code; AWARENESS_GPU_TESTS_ON_CPU=1)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from models import PAIRS, write_random_checkpoints
from pipelines.corpora.random_rows import write_random_corpus
from pipelines.train.configs.common import DeepSpeedSettings, ScalingSettings, TrainConfig
from pipelines.train.configs.stage import DataConfig, ModelConfig, StageConfig
from pipelines.train.plan import GIB, plan_for_stage
from tests.pipelines.train.one_rank import run_one_rank

pytestmark = pytest.mark.gpu

PAIR = os.environ.get("AWARENESS_GPU_TESTS_QLORA_PAIR", "scale")
SEED_CARD_GIB, PLAN_TOLERANCE, STEPS = 40.0, 0.15, 4


def shapes(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"max_tokens": 4096, "chunks": 32, "chunk_len": 512}
    return {"max_tokens": 128, "chunks": 4, "chunk_len": 32}


@pytest.fixture(scope="module")
def qlora_config(tmp_path_factory, device) -> StageConfig:
    root = tmp_path_factory.mktemp("qlora")
    checkpoints = os.environ.get("AWARENESS_GPU_CHECKPOINTS", str(root / "checkpoints"))  # gpu_check.py shares them
    # drawn on the GPU in a process of its own, so none of its memory or CUDA context is left beside the runs measured
    writer = mp.get_context("spawn").Process(target=write_random_checkpoints, args=(PAIRS[PAIR], checkpoints),
                                             kwargs={"dtype": torch.bfloat16, "device": device.type})
    writer.start()
    writer.join()
    assert writer.exitcode == 0, f"writing {PAIR}'s checkpoints failed (exit {writer.exitcode})"
    s = shapes(device)
    vocab = min(PAIRS[PAIR].decoder_config["vocab_size"], PAIRS[PAIR].encoder_config["vocab_size"])
    split = write_random_corpus(root / "corpus", rows=STEPS + 2, max_tokens=s["max_tokens"], chunks=s["chunks"],
                                chunk_len=s["chunk_len"], vocab=vocab)
    cuda = device.type == "cuda"
    config = StageConfig(
        stage=2,
        model=ModelConfig(pair=PAIR, checkpoint_root=checkpoints, decoder="lora", encoder="frozen",
                          gradient_checkpointing=True, quantize="nf4"),
        data=DataConfig(train_path=str(split), max_tokens=s["max_tokens"], max_chunks=s["chunks"],
                        chunk_len=s["chunk_len"], verify_hashes=False),
        train=TrainConfig(max_steps=STEPS, memories_per_step=1, lr=1e-4, warmup_steps=1, optimizer="adamw_8bit"),
        scaling=ScalingSettings(num_workers=1, use_gpu=cuda, gpus_per_node=1, gpu_memory_gib=SEED_CARD_GIB),
        deepspeed=DeepSpeedSettings(zero_stage=None, precision="bf16" if cuda else "fp32"),
    )
    return with_planned_stage(config)


def with_planned_stage(config: StageConfig) -> StageConfig:
    """The ZeRO stage the plan chooses for this card, as the stage recipe's prepare sets it for a GPU job."""
    stage = plan_for_stage(config).zero_stage
    return dataclasses.replace(config, deepspeed=dataclasses.replace(config.deepspeed, zero_stage=stage))


@pytest.fixture(scope="module")
def bf16_config(qlora_config, device) -> StageConfig:
    card = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else 80.0
    config = dataclasses.replace(
        qlora_config, model=dataclasses.replace(qlora_config.model, quantize="none"),
        train=dataclasses.replace(qlora_config.train, optimizer="adamw"),
        scaling=dataclasses.replace(qlora_config.scaling, gpu_memory_gib=card),
        deepspeed=dataclasses.replace(qlora_config.deepspeed, zero_stage=None))
    return with_planned_stage(config)


def measure(config: StageConfig, out) -> dict:
    measured = run_one_rank(config, out)
    plan = plan_for_stage(config)
    tokens = config.data.max_tokens * config.train.memories_per_step
    steady = measured["step_seconds"][1:] or measured["step_seconds"]  # the first step warms the kernels up
    seconds = sorted(steady)[len(steady) // 2]
    peaks = {phase: measured[phase]["peak"] for phase in ("loading", "training")}
    record = {"pair": PAIR, "quantize": config.model.quantize, "optimizer": config.train.optimizer,
              "zero_stage": config.deepspeed.zero_stage, "seconds_per_step": round(seconds, 3),
              "decoder_tokens_per_s": round(tokens / seconds, 1),
              "peak_gib": {k: round(v, 2) for k, v in peaks.items()},
              # a GPU load phase only where the plan has one (a quantized load; a 16-bit pair below ZeRO-3 is built
              # in host memory and moved by DeepSpeed's start, inside the training phase)
              "plan_gib": {"loading": round(plan.load_gib, 2) if plan.load_rows else None,
                           "training": round(plan.total_gib, 2)},
              "losses": measured["losses"], "grad_norms": measured["grad_norms"]}
    print(plan.table())
    print("qlora-gpu " + json.dumps(record), flush=True)
    return record


@pytest.fixture(scope="module")
def qlora(qlora_config, tmp_path_factory) -> dict:
    return measure(qlora_config, tmp_path_factory.mktemp("qlora-run") / "rank0.json")


@pytest.fixture(scope="module")
def bf16(bf16_config, tmp_path_factory) -> dict:
    return measure(bf16_config, tmp_path_factory.mktemp("bf16-run") / "rank0.json")


def assert_trained(record: dict) -> None:
    assert len(record["losses"]) == STEPS
    assert all(math.isfinite(x) for x in record["losses"] + record["grad_norms"])
    assert all(n > 0 for n in record["grad_norms"])


def assert_peaks_match_the_plan(record: dict, device) -> None:
    if device.type != "cuda":
        pytest.skip("GPU memory is measured on CUDA only")
    for phase, peak in record["peak_gib"].items():
        predicted = record["plan_gib"][phase]
        if predicted is None:
            continue
        assert abs(predicted - peak) <= PLAN_TOLERANCE * peak, (phase, predicted, peak)


def test_the_scale_pair_trains_under_qlora_within_a_40_gib_card_and_the_plan(qlora, device):
    assert_trained(qlora)
    if device.type == "cuda":
        assert max(qlora["peak_gib"].values()) < SEED_CARD_GIB, qlora["peak_gib"]
    assert_peaks_match_the_plan(qlora, device)


def test_the_bf16_run_beside_it_trains_and_matches_its_plan(qlora, bf16, device):
    print(f"qlora-gpu tokens/s: nf4 + adamw_8bit {qlora['decoder_tokens_per_s']}, bf16 + adamw "
          f"{bf16['decoder_tokens_per_s']}: {qlora['decoder_tokens_per_s'] / bf16['decoder_tokens_per_s']:.2f}x")
    assert_trained(bf16)
    assert_peaks_match_the_plan(bf16, device)
