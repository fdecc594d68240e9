"""What a run's result depends on besides its config, recorded as MLflow tags: the code's commit, the data's
manifest hash, library versions and hardware."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

REPOSITORY = Path(__file__).resolve().parents[2]
LOCKS = {"cpu": REPOSITORY / "requirements.txt", "cuda": REPOSITORY / "requirements-cuda.txt"}
LOCK_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.MULTILINE)
NOT_LOCKED = {"awareness"}  # this repository's own editable install


def system_info() -> dict[str, str]:
    """Library versions and hardware, as tags: what a result depends on besides the config. No environment
    variables (they may hold secrets)."""
    import torch  # lazy: `python -m pipelines.tracking.lineage --against` (make test-latest) checks a lock without it

    info = {"sys.python": platform.python_version(), "sys.platform": platform.platform(),
            "sys.cpu_count": str(os.cpu_count()), "sys.torch": torch.__version__}
    for module in ("transformers", "peft", "deepspeed", "ray", "mlflow"):
        try:
            info[f"sys.{module}"] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - an optional library missing is not an error here
            info[f"sys.{module}"] = "missing"
    if torch.cuda.is_available():
        info["sys.gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return info | lock_info()


def locked_versions(lock: Path) -> dict[str, str]:
    """Package -> exact version, as a requirements lock (`make lock`'s output) pins them."""
    return {canonicalize_name(name): version for name, version in LOCK_PIN.findall(lock.read_text())}


def installed_versions() -> dict[str, str]:
    """What the environment's site-packages holds. Only there: Ray puts its vendored packages (colorama, ...) on
    sys.path once imported, and they are Ray's files, not installs."""
    site_packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=site_packages)
            if d.metadata["Name"]}


def lock_drift(lock: Path, installed: dict[str, str] | None = None) -> list[str]:
    """How this environment differs from `lock`: 'name locked -> installed' ('missing' / 'not locked' for a
    package on one side only), sorted. Empty when one `make install` from that lock reproduces it."""
    locked, installed = locked_versions(lock), installed_versions() if installed is None else installed
    drift = [f"{name} {version} -> {installed.get(name, 'missing')}" for name, version in locked.items()
             if installed.get(name) != version]
    drift += [f"{name} not locked -> {version}" for name, version in installed.items()
              if name not in locked and name not in NOT_LOCKED]
    return sorted(drift)


def environment_lock(installed: dict[str, str] | None = None) -> Path:
    """The lock this environment was meant to come from: the CPU lock under a CPU torch build, else the CUDA one."""
    installed = installed_versions() if installed is None else installed
    return LOCKS["cpu"] if installed.get("torch", "").endswith("+cpu") else LOCKS["cuda"]


def lock_info() -> dict[str, str]:
    """Tags that say which lock reproduces this run and whether the environment matches it exactly."""
    lock = environment_lock()
    if not lock.is_file():
        return {"sys.lock": "missing"}
    drift = lock_drift(lock)
    return {"sys.lock": f"{lock.name}:{hashlib.sha256(lock.read_bytes()).hexdigest()[:16]}",
            "sys.lock_match": str(not drift).lower(), **({"sys.lock_drift": "; ".join(drift)[:4000]} if drift else {})}


def git_commit() -> str:
    """The code's commit ("+dirty" with uncommitted changes); "unknown" where there is no git checkout (a Ray job's
    uploaded working directory)."""
    root = REPOSITORY
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def data_manifest_hash(train_path: str | None, synthetic: dict[str, Any]) -> str:
    """Identifies the training data: "synthetic:<hash of the generator's settings>" for stage 0's needles, else the
    sha256 of the corpus's manifest (a manifest*.json beside or above the shards), else of its file names and sizes."""
    if not train_path:
        return "synthetic:" + hashlib.sha256(json.dumps(synthetic, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(train_path)
    for directory in (path, path.parent):
        manifests = sorted(directory.glob("manifest*.json")) if directory.is_dir() else []
        if manifests:
            return hashlib.sha256(manifests[0].read_bytes()).hexdigest()[:16]
    if not path.exists():
        return "missing"
    files = sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    listing = [(str(p.relative_to(path)) if path.is_dir() else p.name, p.stat().st_size) for p in files]
    return "listing:" + hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.tracking.lineage --against requirements.txt`: the packages whose installed
    version differs from the lock, one a line (make test-latest prints them)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--against", type=Path, default=None, help="a lock file (default: this environment's)")
    lock = parser.parse_args(argv).against or environment_lock()
    if not lock.is_file():
        print(f"error: {lock} is not a file: name a lock, e.g. requirements.txt", file=sys.stderr)
        return 2
    drift = lock_drift(lock)
    print(f"{len(drift)} package(s) differ from {lock.name}" + "".join(f"\n  {line}" for line in drift))
    return 0


if __name__ == "__main__":
    sys.exit(main())
