"""The fault-tolerance tests' worker hook, installed through $AWARENESS_TRAIN_HOOK (pipelines.train.loop): the
last worker of a run raises once at the event and step `plan` wrote for that run name. A marker file makes it once
per run, across the restarts Ray Train performs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray.train

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
