"""proto1 (Qwen3-0.6B + Qwen3-Embedding-0.6B: random weights of the real architecture, written as bf16 checkpoints)
built the way a stage job builds it, inside DeepSpeed's zero.Init (ZeRO-3, bf16) on one GPU, then trained a few steps
with the pipeline's own step (pipelines.train.loop.train_step: DeepSpeed's backward and step, the loss all-reduced);
its peak GPU memory, loading and training, against jobs/plan.py's prediction for the same run, within 15%.

Measured peak = the CUDA caching allocator's peak reservation in the phase plus what the device holds outside it (CUDA
context, NCCL: the device's used memory minus the allocator's reservation), the quantity the plan predicts. The
measured and predicted tables are printed (pytest -s) for docs/benchmarks.md.

The shapes: a stage-2 run of corpus rows of 2048 decoder tokens and 16 x 512 memory tokens, 4 per step, decoder
LoRA r16, GCA and projection trained, gradient checkpointing on (the plan's default). One rank, spawned: the process
group must not outlive the test. AWARENESS_GPU_TESTS_PAIR=small runs it with the small pair (the CPU dry run)."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models import PAIRS, write_random_checkpoints
from pipelines.corpora.random_rows import write_random_corpus
from pipelines.train.configs.common import DeepSpeedSettings, ScalingSettings, TrainConfig
from pipelines.train.configs.stage import DataConfig, ModelConfig, StageConfig
from pipelines.train.plan import GIB, plan_for_stage

pytestmark = pytest.mark.gpu

PAIR = os.environ.get("AWARENESS_GPU_TESTS_PAIR", "proto1")
STEPS, MEMORIES, MAX_TOKENS, CHUNKS, CHUNK_LEN = 4, 4, 2048, 16, 512
PLAN_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def run_config(tmp_path_factory, device) -> StageConfig:
    root = tmp_path_factory.mktemp("proto1")
    write_random_checkpoints(PAIRS[PAIR], root / "checkpoints", dtype=torch.bfloat16)
    vocab = min(PAIRS[PAIR].decoder_config["vocab_size"], PAIRS[PAIR].encoder_config["vocab_size"])
    split = write_random_corpus(root / "corpus", rows=2 * MEMORIES, max_tokens=MAX_TOKENS, chunks=CHUNKS,
                                chunk_len=CHUNK_LEN, vocab=vocab)
    cuda = device.type == "cuda"
    total_gib = torch.cuda.get_device_properties(device).total_memory / GIB if cuda else 80.0
    return StageConfig(
        stage=2,
        model=ModelConfig(pair=PAIR, checkpoint_root=str(root / "checkpoints"), decoder="lora", encoder="frozen",
                          gradient_checkpointing=True),
        data=DataConfig(train_path=str(split), max_tokens=MAX_TOKENS, max_chunks=CHUNKS, chunk_len=CHUNK_LEN,
                        verify_hashes=False),
        train=TrainConfig(max_steps=STEPS, memories_per_step=MEMORIES, lr=1e-4, warmup_steps=1),
        scaling=ScalingSettings(num_workers=1, use_gpu=cuda, gpus_per_node=1, gpu_memory_gib=total_gib),
        deepspeed=DeepSpeedSettings(zero_stage=3, precision="bf16"),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, config: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        Path(out).write_text(json.dumps(build_and_train(StageConfig.from_dict(config), cuda)))
    finally:
        dist.destroy_process_group()


def device_peak_gib(cuda: bool) -> dict[str, float]:
    """The allocator's peak reservation since the last reset, and the device's memory held outside the allocator."""
    if not cuda:
        return {"reserved": 0.0, "outside_allocator": 0.0}
    free, total = torch.cuda.mem_get_info()
    return {"reserved": torch.cuda.max_memory_reserved() / GIB,
            "allocated": torch.cuda.max_memory_allocated() / GIB,
            "outside_allocator": (total - free - torch.cuda.memory_reserved()) / GIB}


def build_and_train(config: StageConfig, cuda: bool) -> dict:
    """What a stage job's worker does (pipelines.train.loop.train_loop_per_worker), measured phase by phase."""
    from pipelines.train.engine import deepspeed_config, quiet_known_warnings, setup_deepspeed
    from pipelines.train.loop import train_step
    from pipelines.train.recipes import TrainState
    from pipelines.train.recipes.stage import STAGE

    quiet_known_warnings()
    torch.manual_seed(config.train.seed)
    if cuda:
        torch.cuda.set_device(0)
    ds_config = deepspeed_config(config, 1)
    model = STAGE.build_model(config, {}, ds_config)
    loading = device_peak_gib(cuda)
    engine = setup_deepspeed(model, config, STAGE.parameter_groups(model), ds_config)
    stream = STAGE.stream(config, {}, 0, 1, 0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    state, losses, norms, seconds = TrainState(), [], [], []
    for _ in range(config.train.max_steps):
        metrics = train_step(engine, STAGE, config, state, stream)
        losses.append(metrics["loss"])
        norms.append(float(engine.get_global_grad_norm() or 0.0))
        seconds.append(metrics["step_seconds"])
    params = [p for p in engine.module.parameters()]
    return {"loading": loading, "training": device_peak_gib(cuda), "losses": losses, "grad_norms": norms,
            "step_seconds": seconds, "dtypes": sorted({str(p.dtype) for p in params}), "steps": state.step}


@pytest.fixture(scope="module")
def measured(run_config, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("measured") / "rank0.json"
    mp.spawn(_rank, args=(free_port(), run_config.to_dict(), str(out)), nprocs=1, join=True)
    return json.loads(out.read_text())


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
        m = measured[phase]
        print(f"{phase}: measured {m} GiB (peak with the outside = "
              f"{m['reserved'] + m['outside_allocator']:.2f}), plan {predicted:.2f} GiB")
    if device.type != "cuda":
        pytest.skip("GPU memory is measured on CUDA only")
    for phase, predicted in phases.items():
        peak = measured[phase]["reserved"] + measured[phase]["outside_allocator"]
        assert abs(predicted - peak) <= PLAN_TOLERANCE * peak, (phase, predicted, peak)
