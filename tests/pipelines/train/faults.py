"""The fault-tolerance tests' worker hooks, installed through $AWARENESS_TRAIN_HOOK (pipelines.train.hooks).
`inject`: the last worker of a run raises once at the event and step `plan` wrote for that run name. `await_kill`:
the last worker stops at a step and waits for the test to SIGKILL its process. Marker files make each happen once
per run, across the restarts Ray Train performs. `assert_resume_is_exact`: the exact-resume check the tests share."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import ray.train
import torch
from safetensors.torch import load_file

from models.awareness import WEIGHTS_NAME

HOOK = "tests.pipelines.train.faults:inject"
PLAN_ENV = "AWARENESS_FAULT_PLAN"  # a JSON file: {run name: {"fail_at": "train:3", "marker": path}}


def plan(plan_file: Path, run_name: str, fail_at: str, marker: Path) -> None:
    plans = json.loads(plan_file.read_text()) if plan_file.is_file() else {}
    plans[run_name] = {"fail_at": fail_at, "marker": str(marker)}
    plan_file.write_text(json.dumps(plans))


def inject(event: str, step: int) -> None:
    plan_file = Path(os.environ.get(PLAN_ENV, "/nonexistent"))
    context = ray.train.get_context()
    entry = json.loads(plan_file.read_text()).get(context.get_experiment_name()) if plan_file.is_file() else None
    if entry is None or context.get_world_rank() != context.get_world_size() - 1:
        return
    where, at = entry["fail_at"].split(":")
    marker = Path(entry["marker"])
    if event != where or step != int(at) or marker.exists():
        return
    marker.write_text(entry["fail_at"])
    raise RuntimeError(f"injected failure at {event} step {step}")


KILL_DIR_ENV = "AWARENESS_KILL_DIR"  # where await_kill records workers and waits to be killed (the two-node test)
AWAIT_KILL = "tests.pipelines.train.faults:await_kill"


def await_kill(event: str, step: int) -> None:
    """Records each worker's rank, pid and node; then the last worker, at the step named in KILL_DIR/plan.json
    ({"event": "train", "step": 3}), writes its pid to KILL_DIR/victim.json once and waits there for the test to
    SIGKILL it: a real death, not an exception. Fails loudly if nobody kills it."""
    directory = Path(os.environ[KILL_DIR_ENV])
    context = ray.train.get_context()
    rank, pid = context.get_world_rank(), os.getpid()
    seen = directory / f"worker-{rank}-{pid}.json"
    if not seen.exists():
        seen.write_text(json.dumps({"rank": rank, "pid": pid, "node": ray.get_runtime_context().get_node_id()}))
    plan = json.loads((directory / "plan.json").read_text())
    victim = directory / "victim.json"
    if rank != context.get_world_size() - 1 or (event, step) != (plan["event"], plan["step"]) or victim.exists():
        return
    victim.write_text(json.dumps({"pid": pid, "step": step}))
    time.sleep(300)
    raise RuntimeError(f"await_kill: worker {pid} waited 300 s at {event} step {step} and was never killed")


def assert_resume_is_exact(config_of: Callable[[str], Any], fault_plan: Path, tmp_path: Path,
                           steps: int, fail_at: str = "train:3") -> dict[str, dict]:
    """Trains `config_of(name)` twice, "uninterrupted" and "killed" (its last worker raises once at `fail_at`, and
    Ray Train restarts it from the last checkpoint), and asserts both ran `steps` steps and exported the same weights
    bit for bit. Returns the two job summaries."""
    from pipelines.train.recipes.jobs import train  # Ray Train and DeepSpeed: only the driver-side tests need it

    summaries = {}
    for name in ("uninterrupted", "killed"):
        config = config_of(name)
        if name == "killed":
            plan(fault_plan, config.run.name, fail_at, tmp_path / "injected-killed")
        summaries[name] = train(config)
        assert summaries[name]["error"] is None and summaries[name]["steps"] == steps, summaries[name]
    assert (tmp_path / "injected-killed").is_file()  # it did fail
    exports = {name: load_file(Path(summary["export"]) / WEIGHTS_NAME) for name, summary in summaries.items()}
    assert exports["killed"].keys() == exports["uninterrupted"].keys()
    for name, tensor in exports["uninterrupted"].items():
        assert torch.equal(exports["killed"][name], tensor), name
    return summaries
