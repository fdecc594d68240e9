"""Fixtures shared by the pipeline tests: a real `mlflow server` on loopback (one per session, ~20 s to start on 2
cores), the offline tokenizer, real third-party source (installed packages), and one Ray session per module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.format.tokenizer import cached_tokenizer
from pipelines.serving.loopback import MlflowServer


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tokenizer():
    return cached_tokenizer(None)


@pytest.fixture(scope="session")
def package_roots() -> dict[str, Path]:
    """Source trees nobody here wrote: the installed `requests` and `click` packages."""
    import click
    import requests

    return {"requests": Path(requests.__file__).parent, "click": Path(click.__file__).parent}


@pytest.fixture(scope="module")
def ray_local():
    import ray

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    yield
    ray.shutdown()
