"""The Ray a data job (corpus build, memory encoding, stage 3) runs on, started and shut down in one place."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import ray


@contextmanager
def data_job_ray(num_cpus: int | None, *, log_to_driver: bool = True) -> Iterator[None]:
    """`num_cpus` asks for a local instance of that size; without it, Ray joins $RAY_ADDRESS or a cluster started on
    this machine (`ray start`), else starts one with every CPU. Shut down however the job ends."""
    ray.init(address="local" if num_cpus else None, num_cpus=num_cpus, include_dashboard=False,
             ignore_reinit_error=True, log_to_driver=log_to_driver)
    try:
        yield
    finally:
        ray.shutdown()
