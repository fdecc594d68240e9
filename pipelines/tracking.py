"""MLflow tracking: the driver opens a run, rank 0 logs into it, and a tracking failure never stops training.

Nothing from the environment is logged: params are the resolved config, which holds no secrets.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pipelines.config import flatten

log = logging.getLogger(__name__)


def resolve_tracking_uri(configured: str | None) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI, else MLflow's embedded default: sqlite:///mlflow.db in the
    working directory (made absolute, so Ray workers in other directories write to the same store)."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


class Tracker:
    """Logs to one MLflow run through an explicit client. A call that fails (server down, network) is kept and
    retried on the next call; what never got through is listed by `close()` instead of raising."""

    def __init__(self, tracking_uri: str | None, run_id: str | None):
        self.run_id = run_id
        self.pending: list[tuple[str, tuple, dict]] = []
        self.failures = 0
        self.client = None
        if run_id:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri)

    @classmethod
    def start(cls, tracking_uri: str, experiment: str, run_name: str, config: dict[str, Any],
              tags: dict[str, str] | None = None, run_id: str | None = None) -> "Tracker":
        """Opens (or reopens, when resuming) a run and logs the resolved config as params and as a JSON file."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        if run_id is None:
            found = client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else client.create_experiment(experiment)
            run_id = client.create_run(experiment_id, run_name=run_name, tags=tags or {}).info.run_id
            tracker = cls(tracking_uri, run_id)
            tracker.log_params(flatten(config))
            tracker.log_dict(config, "config.json")
        else:
            tracker = cls(tracking_uri, run_id)
        return tracker

    def _call(self, method: str, *args, **kwargs) -> None:
        if self.client is None:
            return
        queue = [*self.pending, (method, args, kwargs)]
        self.pending = []
        for i, (name, a, kw) in enumerate(queue):
            try:
                getattr(self, f"_{name}")(*a, **kw)
            except Exception as error:  # noqa: BLE001 - tracking must never stop training
                self.failures += 1
                log.warning("MLflow %s failed (%s); will retry", name, error)
                self.pending = queue[i:]
                return

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._call("log_metrics", {k: float(v) for k, v in metrics.items()}, step)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_params(self, params: dict[str, Any]) -> None:
        self._call("log_params", {k: str(v)[:6000] for k, v in params.items()})

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log_dict(self, data: dict[str, Any], name: str) -> None:
        self._call("log_dict", data, name)

    def _log_dict(self, data: dict[str, Any], name: str) -> None:
        self.client.log_dict(self.run_id, data, name)

    def log_artifacts(self, directory: str | Path, artifact_path: str) -> None:
        self._call("log_artifacts", str(directory), artifact_path)

    def _log_artifacts(self, directory: str, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, directory, artifact_path)

    def log_figure(self, figure, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:  # rendered now: the figure may be gone at a retry
            path = Path(tmp) / name
            figure.savefig(path, dpi=100, bbox_inches="tight")
            self._call("log_bytes", path.read_bytes(), name)

    def _log_bytes(self, data: bytes, name: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / name).write_bytes(data)
            self.client.log_artifact(self.run_id, str(Path(tmp) / name))

    def close(self, status: str = "FINISHED") -> list[str]:
        """Flushes what is pending, ends the run, and returns what could not be logged."""
        self._call("terminate", status)
        return [name for name, _, _ in self.pending]

    def _terminate(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


def summary_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, sort_keys=False, default=str)
