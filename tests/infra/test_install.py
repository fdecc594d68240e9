"""The install: both locks pin every dependency inside pyproject.toml's ranges, with hashes, and agree with each
other; this environment is the CPU lock; the documented make targets expand to the commands docs/install.md
describes; the CUDA lock resolves for a fresh Linux venv. How lineage reports drift from a lock:
tests/pipelines/tracking/test_lineage.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pipelines.tracking.lineage import LOCKS, environment_lock, lock_drift, lock_info, locked_versions

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
DIRECT = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] + EXTRAS["test"] + EXTRAS["install"]]
UV = Path(sys.prefix) / "bin" / "uv"


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_lock_pins_every_direct_dependency_inside_its_range_with_hashes(flavour):
    text = LOCKS[flavour].read_text()
    locked = locked_versions(LOCKS[flavour])
    for requirement in DIRECT:
        version = locked.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not in {LOCKS[flavour].name}: run make lock"
        assert requirement.specifier.contains(version, prereleases=True), (requirement, version)
    pins = re.findall(r"^\S+==\S+ \\\n((?:\s+--hash=sha256:[0-9a-f]{64}.*\n)+)", text, re.MULTILINE)
    assert len(pins) == len(locked), "every pin carries its sha256 hashes"


def test_the_locks_agree_on_everything_but_torch_and_its_cuda_libraries():
    cpu, cuda = locked_versions(LOCKS["cpu"]), locked_versions(LOCKS["cuda"])
    assert cpu["torch"].endswith("+cpu") and not cuda["torch"].endswith("+cpu")
    assert cpu["torch"].split("+")[0] == cuda["torch"]
    shared = [name for name in cpu if name != "torch"]
    assert {name: cpu[name] for name in shared} == {name: cuda.get(name) for name in shared}
    only_cuda = set(cuda) - set(cpu)
    cuda_extra = {canonicalize_name(Requirement(r).name) for r in EXTRAS["cuda"]}  # Liger-Kernel: Triton kernels
    assert cuda_extra <= only_cuda, "the cuda extra is in the CUDA lock: run make lock"
    assert all(n.startswith(("nvidia-", "cuda-")) or n in {"triton", *cuda_extra} for n in only_cuda), only_cuda


def test_this_environment_is_the_cpu_lock():
    import ray  # noqa: F401 - once imported, Ray puts its vendored packages on sys.path: they are not installs
    assert environment_lock() == LOCKS["cpu"]
    assert lock_drift(LOCKS["cpu"]) == [], "the venv differs from the lock: run make install"
    tags = lock_info()
    assert tags["sys.lock_match"] == "true" and tags["sys.lock"].startswith("requirements.txt:")


def _make_dry_run(*args: str) -> str:
    return subprocess.run(["make", "-n", "-B", *args], capture_output=True, text=True, cwd=ROOT, check=True).stdout


def test_make_install_syncs_the_named_lock_with_hashes():
    for lock in ("requirements.txt", "requirements-cuda.txt"):
        commands = _make_dry_run("install", f"LOCK={lock}")
        sync = next(line for line in commands.splitlines() if " pip sync " in line)
        assert "--require-hashes" in sync and sync.endswith(lock)
        assert "--compile-bytecode" in sync  # no process has to compile torch itself, PYTHONDONTWRITEBYTECODE or not
        assert "pip check" in commands and "-e ." in commands


def test_make_lock_and_test_latest_resolve_from_pyproject():
    lock = _make_dry_run("lock")
    assert "--override .venv/torch-cpu.txt" in lock and "-o requirements.txt" in lock
    assert "--constraint .venv/cpu-pins.txt" in lock and "-o requirements-cuda.txt" in lock
    latest = _make_dry_run("test-latest")
    assert "-o .venv-latest/resolved.txt" in latest and "--upgrade" in latest
    assert "pipelines.tracking.lineage --against requirements.txt" in latest
    assert '.venv-latest/bin/python -m pytest -m "not slow and not ray" tests/models tests/pipelines/data' in latest


@pytest.mark.skipif(not UV.exists() or shutil.which("make") is None, reason="uv is installed by make install")
def test_the_cuda_lock_resolves_for_a_fresh_linux_venv(tmp_path):
    """The documented CUDA path, up to the download: every pin is served for Linux x86_64 / Python 3.11."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    result = subprocess.run([str(UV), "pip", "sync", "--dry-run", "--require-hashes", "--python",
                             str(tmp_path / "venv" / "bin" / "python"), str(LOCKS["cuda"])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"\+ torch==2\.13\.0\n", result.stderr) and "+ nvidia-cublas" in result.stderr
