"""One rank of a stage job without Ray: the worker loop's own build, DeepSpeed engine and training step
(pipelines.train.loop.train_step) in a spawned process (the process group must not outlive the test), with the loss,
gradient norm and peak GPU memory of each phase. The bf16-against-fp32 loss test and the GPU memory-plan test use it."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipelines.train.configs.stage import StageConfig
from pipelines.train.plan import GIB, measured_peak_gib


def run_one_rank(config: StageConfig, out: Path) -> dict:
    """Builds and trains `config` for train.max_steps on one rank (NCCL on CUDA, else gloo); its record."""
    mp.spawn(_rank, args=(free_port(), config.to_dict(), str(out)), nprocs=1, join=True)
    return json.loads(out.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(_: int, port: int, config: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        Path(out).write_text(json.dumps(build_and_train(StageConfig.from_dict(config), cuda)))
    finally:
        dist.destroy_process_group()


def device_peak_gib(cuda: bool) -> dict[str, float]:
    """The peak since the last reset as a GPU job reports it (pipelines.train.plan.measured_peak_gib: the allocator's
    peak reservation plus what the device holds outside it), and the allocator's peak allocation beside it."""
    if not cuda:
        return {"peak": 0.0, "allocated": 0.0}
    return {"peak": measured_peak_gib(), "allocated": torch.cuda.max_memory_allocated() / GIB}


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


