"""A local Ray per test module whose workers carry the fault hook (tests/pipelines/train/faults.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.train.hooks import HOOK_ENV
from tests.pipelines.train import faults


@pytest.fixture(scope="module")
def fault_plan(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults") / "plan.json"


@pytest.fixture(scope="module")
def local_ray(fault_plan):
    """Workers get the fault hook; it does nothing for runs the plan does not name."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {HOOK_ENV: faults.HOOK, faults.PLAN_ENV: str(fault_plan)}})
    yield
    ray.shutdown()  # only this test's local instance; never `ray stop`
