"""Ray nodes for the job-submission tests: `ray start --block` processes, each with its own temp dir and every port of
their own (another Ray on this machine, a user's or a test's, holds the default ones: a second dashboard agent on
52365 never comes up, and the job server then answers "No available agent"), stopped by process group, never with
`ray stop`, which would kill every Ray process on the machine."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

RAY = Path(sys.executable).parent / "ray"


WORKER_PORTS = range(20000, 32000)  # below Linux's ephemeral range (32768-60999), where free_port draws from


def free_port() -> int:
    """A free port outside every test cluster's worker range (Ray refuses a component port inside one)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in WORKER_PORTS:
            return port


def own_ports(first_worker_port: int) -> list[str]:
    ports = {name: free_port() for name in ("node-manager", "object-manager", "metrics-export", "runtime-env-agent",
                                            "dashboard-agent-listen", "dashboard-agent-grpc")}
    return [f"--{name}-port={port}" for name, port in ports.items()] + [
        f"--min-worker-port={first_worker_port}", f"--max-worker-port={first_worker_port + 999}"]


@contextmanager
def ray_cluster(nodes: int, cpus_per_node: int, env: dict[str, str]) -> Iterator[str]:
    """A head and `nodes - 1` workers on this machine; yields the job server's address once it has run a job."""
    port, dashboard = free_port(), free_port()
    temp_dir = Path("/tmp") / f"ray-test-{secrets.token_hex(3)}"  # short: Ray's socket paths have a length limit
    worker_ports = WORKER_PORTS.start + 3000 * (os.getpid() % 4)  # a range per test process and node (3 at most)
    head = [str(RAY), "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dashboard}",
            "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--ray-client-server-port={free_port()}",
            f"--temp-dir={temp_dir}", f"--num-cpus={cpus_per_node}", "--disable-usage-stats",
            *own_ports(worker_ports)]
    logs = Path(f"{temp_dir}.log")  # each `ray start`'s output: a failed start shows it
    log = logs.open("w")
    processes = [subprocess.Popen(head, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)]
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for_jobs(address, env, processes, logs)
        for n in range(1, nodes):
            # a temp dir per node too: a node's runtime-env agent deletes the job packages it unpacked there
            worker = [str(RAY), "start", "--block", f"--address=127.0.0.1:{port}", f"--num-cpus={cpus_per_node}",
                      f"--temp-dir={temp_dir}-{n}", "--disable-usage-stats", *own_ports(worker_ports + 1000 * n)]
            processes.append(subprocess.Popen(worker, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        wait_for_nodes(nodes, address, env, processes, logs)
        yield address
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # the node and what it started, by process group
                process.wait(timeout=60)
        for n in range(nodes):
            shutil.rmtree(f"{temp_dir}-{n}" if n else temp_dir, ignore_errors=True)
        log.close()
        logs.unlink(missing_ok=True)


def started(processes: list[subprocess.Popen], logs: Path) -> None:
    """Every `ray start` still running, else the failure with what they printed."""
    assert all(p.poll() is None for p in processes), f"a `ray start` process exited:\n{logs.read_text()[-3000:]}"


def wait_for_jobs(address: str, env: dict[str, str], processes: list[subprocess.Popen], logs: Path,
                  timeout: float = 180) -> None:
    """Until a trivial job runs: the job agent comes up after the job server answers."""
    deadline = time.time() + timeout
    while subprocess.run([str(RAY), "job", "submit", "--address", address, "--", "python", "-c", "pass"],
                         env=env, capture_output=True).returncode:
        started(processes, logs)
        assert time.time() < deadline, f"the head node's job server did not run a job in {timeout:.0f} s"
        time.sleep(3)


def wait_for_nodes(nodes: int, address: str, env: dict[str, str], processes: list[subprocess.Popen], logs: Path,
                   timeout: float = 120) -> None:
    count = "import ray; ray.init(); print('ALIVE', sum(n['Alive'] for n in ray.nodes()))"
    deadline = time.time() + timeout
    while True:
        run = subprocess.run([str(RAY), "job", "submit", "--address", address, "--", "python", "-c", count],
                             env=env, capture_output=True, text=True)
        if f"ALIVE {nodes}" in run.stdout:
            return
        started(processes, logs)
        assert time.time() < deadline, f"{nodes} nodes did not join in {timeout:.0f} s: {run.stdout[-500:]}"
        time.sleep(3)
