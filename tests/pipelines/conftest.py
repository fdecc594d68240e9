"""A real `mlflow server` on loopback, one per test session (its start-up takes ~20 s on 2 cores)."""

from __future__ import annotations

import pytest

from tests.pipelines.mlflow_server import MlflowServer


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()
