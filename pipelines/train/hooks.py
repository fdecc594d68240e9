"""The training loop's one extension point: a function every Ray Train worker calls at named points of its loop.

$AWARENESS_TRAIN_HOOK names it as "module:function"; an environment variable because it must reach the worker
processes: set it in the job's runtime_env `env_vars` (or the local Ray's), and each worker imports the module.
The loop calls `function(event, step)` at these events, on every rank:
  "train"  after optimizer step `step` (its loss all-reduced), before that step's logging, evaluation or checkpoint;
  "save"   once step `step`'s checkpoint is whole on this worker (ZeRO shard, loop state, export) and before it is
           reported to Ray Train, so a hook that raises there leaves that checkpoint unregistered.
Whatever the hook raises fails the worker as the loop's own error would. Unset, nothing is called.
The loop knows nothing of what a hook does; the fault-tolerance tests' hooks are in tests/pipelines/train/faults.py."""

from __future__ import annotations

import importlib
import os
from typing import Callable

HOOK_ENV = "AWARENESS_TRAIN_HOOK"

Hook = Callable[[str, int], None]


def installed_hook() -> Hook:
    """The function $AWARENESS_TRAIN_HOOK names, else one that does nothing."""
    spec = os.environ.get(HOOK_ENV)
    if not spec:
        return lambda event, step: None
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)
