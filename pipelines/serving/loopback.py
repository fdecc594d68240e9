"""MLflow's own servers as subprocesses on loopback, for tests and benchmarks: `mlflow server` over a temporary SQLite
store and artifact root, and `mlflow models serve` of one model URI. Each runs in its own session and is stopped by its
process group (the workers it forks included), never by name."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path


class _Subprocess:
    """A server this module started: stopped by its process group, and a context manager around start/stop."""

    port: int
    process: subprocess.Popen | None = None

    def start(self, timeout: float = 300):
        raise NotImplementedError

    def stop(self) -> None:
        _stop(self.process, self.port)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MlflowServer(_Subprocess):
    """A tracking server and model registry: SQLite at ROOT/store.db, artifacts under ROOT/artifacts."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = Path(root)
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        self.uri = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                        "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'store.db'}",
                        "--artifacts-destination", str(self.root / "artifacts")]

    def start(self, timeout: float = 300) -> "MlflowServer":
        # Without its background job runner (GenAI evaluation jobs, unused here) it starts faster and exits on SIGTERM.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.root.mkdir(parents=True, exist_ok=True)
        self.process = _serve(self.command, env, self.root / "server.log", f"{self.uri}/health", "mlflow server",
                              timeout)
        return self


def _serve(command: list[str], env: dict[str, str], log_path: Path, ready_url: str, what: str,
           timeout: float) -> subprocess.Popen:
    """Starts `command` in its own session (so _stop signals exactly it and the workers it forks) and waits until
    ready_url answers 200."""
    log = open(log_path, "ab")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(command, stdout=log, stderr=log, cwd=log_path.parent, start_new_session=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited: {log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(ready_url, timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    _stop(process, urllib.parse.urlsplit(ready_url).port)
    raise TimeoutError(f"{what} did not answer on {ready_url} within {timeout}s")


def _stop(process: subprocess.Popen | None, port: int) -> None:
    if process is None or process.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)  # the group of the process this object started
        except ProcessLookupError:
            break
        try:
            process.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    _wait_port_closed(port)


def free_port() -> int:
    """A port free on loopback now (the OS's choice; a server started soon after takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port_closed(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.2)


class ModelServer(_Subprocess):
    """`mlflow models serve` of one model URI on loopback, as a user serves a registered version (docs/tracking.md).
    `env` adds to the server's environment (e.g. OMP_NUM_THREADS)."""

    def __init__(self, model_uri: str, tracking_uri: str, root: Path, *, port: int | None = None, workers: int = 1,
                 env: dict[str, str] | None = None):
        self.model_uri, self.tracking_uri, self.root = model_uri, tracking_uri, Path(root)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.extra_env = dict(env or {})
        self.command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", self.model_uri, "--env-manager",
                        "local", "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(workers)]

    def start(self, timeout: float = 300) -> "ModelServer":
        # the venv's bin on PATH, as after `source .venv/bin/activate`: the scoring server is run as `uvicorn`
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        env = {**os.environ, "MLFLOW_TRACKING_URI": self.tracking_uri, "PATH": path, **self.extra_env}
        self.root.mkdir(parents=True, exist_ok=True)
        self.process = _serve(self.command, env, self.root / "serve.log", f"{self.url}/ping", "mlflow models serve",
                              timeout)
        return self

    def predict(self, rows: list[dict], params: dict | None = None) -> list:
        """POST /invocations with dataframe_records, as docs/tracking.md's curl does; the answers."""
        body = {"dataframe_records": rows, **({"params": params} if params else {})}
        request = urllib.request.Request(f"{self.url}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            return json.loads(response.read())["predictions"]
