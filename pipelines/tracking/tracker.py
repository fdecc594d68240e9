"""MLflow tracking: the driver opens a run, rank 0 logs into it, and a tracking failure never stops training.

Nothing from the environment is logged: params are the resolved config (with anything secret-looking redacted),
tags are versions, the git commit and the data's manifest hash.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests a run under its parent
SECRET_KEY = re.compile(r"token|secret|password|passwd|credential|api_?key|auth", re.IGNORECASE)
REDACTED = "<redacted>"
# MLflow's HTTP client retries a refused connection 7 times with exponential backoff (minutes per call); with the
# server down that would stall the training step, so the Tracker asks for a short retry and queues instead.
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
RETRY_INTERVAL_S = 20.0  # after a failure, calls only queue until this much time has passed


QUEUED_CALLS = {"log_metrics", "log_params", "log_dict", "log_artifacts", "log_bytes", "log_table", "log_text",
                "set_tags", "delete_tags", "terminate"}  # what a saved queue may replay


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}: the params MLflow records (the flags' names)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _encode(value):
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot queue {type(value).__name__} for MLflow")


def _decode(value: dict):
    return base64.b64decode(value["__bytes__"]) if set(value) == {"__bytes__"} else value


def resolve_tracking_uri(configured: str | None) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI, else MLflow's embedded default: sqlite:///mlflow.db in the
    working directory (made absolute, so Ray workers in other directories write to the same store)."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


LOOPBACK = ("localhost", "127.0.0.1", "::1")


def for_other_nodes(tracking_uri: str, node_ip: str) -> str:
    """The tracking URI as a process on another node must use it: a server the driver names by loopback (the head's
    http://127.0.0.1:5000, where the job's driver runs) is the driver node's address `node_ip`; any other URI is
    unchanged."""
    parts = urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK:
        return tracking_uri
    userinfo = parts.netloc.rpartition("@")[0]
    host = f"[{node_ip}]" if ":" in node_ip else node_ip  # an IPv6 address is bracketed in a URI
    netloc = (f"{userinfo}@" if userinfo else "") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def mlflow_client(tracking_uri: str | None):
    """MLflow's client with a short HTTP retry (HTTP_RETRY_DEFAULTS; a user's own setting wins)."""
    # lazy (~2-5 s on 2 cores): the training jobs' --help, --dry-run and refusals import this module (summary_json,
    # resolve_tracking_uri) and never log; the workers have MLflow already (DeepSpeed imports it)
    from mlflow.tracking import MlflowClient

    for name, value in HTTP_RETRY_DEFAULTS.items():
        os.environ.setdefault(name, value)
    return MlflowClient(tracking_uri)


class Tracker:
    """Logs to one MLflow run through an explicit client. A call that fails (server down, network) is kept and
    retried on the next call; what never got through is listed by `close()` instead of raising."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, *, retry_interval_s: float = RETRY_INTERVAL_S):
        self.run_id = run_id
        self.pending: list[tuple[str, tuple, dict]] = []
        self.failures = 0
        self.retry_interval_s = retry_interval_s
        self.retry_at = 0.0  # monotonic time before which a call queues without touching the network
        self.client = None
        if run_id:
            self.client = mlflow_client(tracking_uri)

    @classmethod
    def start(cls, tracking_uri: str, experiment: str, run_name: str, config: dict[str, Any],
              tags: dict[str, str] | None = None, run_id: str | None = None) -> "Tracker":
        """Opens (or reopens, when resuming) a run and logs the resolved config as params and as a JSON file."""
        client = mlflow_client(tracking_uri)
        if run_id is None:
            try:
                found = client.get_experiment_by_name(experiment)
                experiment_id = found.experiment_id if found else client.create_experiment(experiment)
                run_id = client.create_run(experiment_id, run_name=run_name, tags=tags or {}).info.run_id
            except Exception as error:  # noqa: BLE001 - re-raised with what to do
                raise RuntimeError(
                    f"cannot open an MLflow run at {_strip_userinfo(tracking_uri)} ({_short(error)}): "
                    f"start the tracking server, point MLFLOW_TRACKING_URI (or --tracking.tracking_uri) at a running "
                    f"one, or pass --tracking.enabled false; nothing has been trained yet"
                ) from error
            tracker = cls(tracking_uri, run_id)
            tracker.log_params(redact(flatten(config)))
            tracker.log_dict(redact_tree(config), "config.json")
        else:
            tracker = cls(tracking_uri, run_id)
        return tracker

    def _call(self, method: str, *args, force: bool = False, **kwargs) -> None:
        """Runs the queued calls, then this one, in order; the first failure keeps the rest queued. While the server
        is known to be down (a failure less than retry_interval_s ago) calls only queue, so steps are not stalled."""
        if self.client is None:
            return
        self.pending.append((method, args, kwargs))
        if not force and time.monotonic() < self.retry_at:
            return
        self.flush()

    def flush(self) -> list[str]:
        """Tries every queued call now; returns the names of those still unlogged."""
        queue, self.pending = self.pending, []
        for i, (name, a, kw) in enumerate(queue):
            try:
                getattr(self, f"_{name}")(*a, **kw)
            except Exception as error:  # noqa: BLE001 - tracking must never stop training
                self.failures += 1
                self.retry_at = time.monotonic() + self.retry_interval_s
                log.warning("MLflow %s failed (%s); %d call(s) queued for retry", name, _short(error), len(queue) - i)
                self.pending = queue[i:]
                break
        return self.unlogged()

    def unlogged(self) -> list[str]:
        return [name for name, _, _ in self.pending]

    def save_pending(self, path: str | Path | None) -> None:
        """Hands what this process could not log to another process (a worker's queue to the driver), as JSON:
        a file in the run directory is data, never code to unpickle."""
        if path and self.pending:
            Path(path).write_text(json.dumps([[name, list(a), kw] for name, a, kw in self.pending], default=_encode))
        elif path:
            Path(path).unlink(missing_ok=True)  # an earlier save's calls have since been logged

    def adopt_pending(self, path: str | Path | None) -> None:
        """Takes over a queue saved by `save_pending` (the same run); it is retried with this tracker's calls."""
        if path and Path(path).is_file() and self.client is not None:
            saved = json.loads(Path(path).read_text(), object_hook=_decode)
            known = [(name, tuple(a), kw) for name, a, kw in saved if name in QUEUED_CALLS]
            self.pending = [*known, *self.pending]
            Path(path).unlink()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._call("log_metrics", {k: float(v) for k, v in metrics.items()}, step)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # lazy: see mlflow_client

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_params(self, params: dict[str, Any]) -> None:
        self._call("log_params", {k: str(v)[:6000] for k, v in redact(params).items()})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._call("set_tags", {k: str(v)[:5000] for k, v in tags.items()})

    def _set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag  # lazy: see mlflow_client

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def delete_tags(self, keys: list[str]) -> None:
        if keys:
            self._call("delete_tags", list(keys))

    def _delete_tags(self, keys: list[str]) -> None:
        present = self.client.get_run(self.run_id).data.tags  # a replayed call may find some already gone
        for key in keys:
            if key in present:
                self.client.delete_tag(self.run_id, key)

    def log_table(self, data: dict[str, list], name: str) -> None:
        """A table (columns of equal length) as MLflow's table artifact, which the UI's evaluation view reads."""
        self._call("log_table", data, name)

    def _log_table(self, data: dict[str, list], name: str) -> None:
        import pandas as pd  # lazy (~1-2 s): only tables need it, and the jobs' --help imports this module

        self.client.log_table(self.run_id, pd.DataFrame(data), name)

    def log_text(self, text: str, name: str) -> None:
        self._call("log_text", text, name)

    def _log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param  # lazy: see mlflow_client

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
        """Flushes what is pending (retrying now, however recent the last failure), ends the run, and returns what
        could not be logged."""
        self._call("terminate", status, force=True)
        if self.pending:
            log.warning("MLflow run %s: not logged (server unreachable): %s", self.run_id, self.unlogged())
        return self.unlogged()

    def _terminate(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status)


def summary_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, sort_keys=False, default=str)


def _short(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:200]


# ---------------------------------------------------------------------------------------------- what is logged
def redact(params: dict[str, Any]) -> dict[str, Any]:
    """Flat params with secret-looking keys blanked and credentials stripped out of URIs (a tracking URI may carry
    user:password@host)."""
    return {k: REDACTED if SECRET_KEY.search(k.rsplit(".", 1)[-1]) and v not in (None, "") else _strip_userinfo(v)
            for k, v in params.items()}


def redact_tree(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: REDACTED if SECRET_KEY.search(str(k)) and v not in (None, "") and not isinstance(v, dict)
                else redact_tree(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redact_tree(v) for v in data]
    return _strip_userinfo(data)


def _strip_userinfo(value: Any) -> Any:
    if not isinstance(value, str) or "@" not in value or "://" not in value:
        return value
    parts = urlsplit(value)
    if parts.password is None and parts.username is None:
        return value
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc=f"{REDACTED}@{host}" + (f":{parts.port}" if parts.port else "")))
