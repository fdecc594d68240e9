"""cluster.yaml is checked against the cluster-config schema shipped inside the ray package, and its commands are
run here as far as a machine without AWS allows: every command parses as bash, the EFS mount runs against stand-ins
for sudo and mountpoint, and the head's MLflow server command starts a real server that outlives its shell."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
COMMAND_LISTS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                 "head_start_ray_commands", "worker_start_ray_commands")


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def commands(config: dict) -> list[str]:
    return [command for key in COMMAND_LISTS for command in config.get(key, [])]


def test_cluster_yaml_matches_rays_schema(config):
    # As `ray up` sees it, merged with the provider's defaults; jsonschema.ValidationError names the offending path.
    validate_config(prepare_config(config))
    workers = config["available_node_types"]["gpu_worker"]
    assert workers["min_workers"] >= 2  # the scale and prod pairs are planned for two 8-GPU nodes
    assert any("pip install" in c and "-e" in c for c in config["setup_commands"])  # installs this project
    assert all("export " not in c for c in config["setup_commands"])  # job env belongs in runtime_env


def test_every_command_is_valid_bash(config):
    for command in commands(config):
        result = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert result.returncode == 0, (command, result.stderr)


def test_shared_storage_is_mounted_before_anything_uses_it(config):
    setup = config["setup_commands"]
    mount = next(i for i, c in enumerate(setup) if "mount -t nfs4" in c)
    assert all("/mnt/shared" not in c for c in setup[:mount])
    assert any("nfs-common" in c for c in setup[:mount])  # the NFS client, before the mount needs it


def fake_bin(tmp_path: Path, log: Path) -> Path:
    """sudo that logs its command and runs only mkdir; mountpoint that says nothing is mounted yet."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text(f'#!/bin/sh\necho "$*" >> {log}\n[ "$1" = mkdir ] && exec "$@"\nexit 0\n')
    (bin_dir / "mountpoint").write_text("#!/bin/sh\nexit 1\n")
    for tool in ("sudo", "mountpoint"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def test_the_efs_mount_refuses_the_placeholder_then_mounts_the_users_file_system(config, tmp_path):
    mount = next(c for c in config["setup_commands"] if "mount -t nfs4" in c)
    shared, log = tmp_path / "shared", tmp_path / "sudo.log"
    env = {**os.environ, "PATH": f"{fake_bin(tmp_path, log)}{os.pathsep}{os.environ['PATH']}"}
    refused = subprocess.run(["bash", "-c", mount.replace("/mnt/shared", str(shared))], env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 1 and "set EFS_DNS" in refused.stderr and not log.exists()

    users = mount.replace("fs-SET-ME.efs", "fs-0123abcd.efs").replace("/mnt/shared", str(shared))
    result = subprocess.run(["bash", "-c", users], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == f"mkdir -p {shared}" and shared.is_dir()
    assert calls[1].startswith("mount -t nfs4 -o nfsvers=4.1,")
    assert calls[1].endswith(f"fs-0123abcd.efs.us-west-2.amazonaws.com:/ {shared}")
    assert calls[2] == f"chown ubuntu {shared}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_processes(marker: str) -> list[int]:
    """PIDs whose command line holds `marker` (this test's unique directory): only what this test started."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_the_heads_mlflow_server_outlives_its_shell_and_starts_once(config, tmp_path):
    """The head start command as the launcher runs it (a shell that exits), on a temporary directory and port."""
    command = next(c for c in config["head_start_ray_commands"] if "mlflow server" in c)
    shared, port = tmp_path / f"shared-{secrets.token_hex(4)}", free_port()
    command = command.replace("/mnt/shared", str(shared)).replace(":5000", f":{port}").replace("--port 5000",
                                                                                               f"--port {port}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    started = time.monotonic()
    subprocess.run(["bash", "-c", command], env=env, check=True, timeout=60)  # returns at once: the server is detached
    assert time.monotonic() - started < 30
    try:
        deadline = time.monotonic() + 180
        while not healthy(port):
            assert time.monotonic() < deadline, (shared / "mlflow" / "server.log").read_text()[-3000:]
            time.sleep(1)
        first = set(own_processes(str(shared)))
        assert all(os.getpgid(pid) != os.getpgrp() for pid in first)  # detached: nothing left in the shell's group
        subprocess.run(["bash", "-c", command], env=env, check=True, timeout=60)  # a second `ray up`
        time.sleep(2)
        assert set(own_processes(str(shared))) == first  # no second server
        assert (shared / "mlflow" / "mlflow.db").is_file()  # the store on (here: stand-in) shared storage
    finally:
        for pid in own_processes(str(shared)):
            try:  # setsid made the server its own process group (its workers are in it)
                os.killpg(pid, signal.SIGTERM) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
