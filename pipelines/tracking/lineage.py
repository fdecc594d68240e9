"""What a run's result depends on besides its config, recorded as MLflow tags: the code's commit, the data's
manifest hash, library versions and hardware."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[2]


def system_info() -> dict[str, str]:
    """Library versions and hardware, as tags: what a result depends on besides the config. No environment
    variables (they may hold secrets)."""
    import torch

    info = {"sys.python": platform.python_version(), "sys.platform": platform.platform(),
            "sys.cpu_count": str(os.cpu_count()), "sys.torch": torch.__version__}
    for module in ("transformers", "peft", "deepspeed", "ray", "mlflow"):
        try:
            info[f"sys.{module}"] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - an optional library missing is not an error here
            info[f"sys.{module}"] = "missing"
    if torch.cuda.is_available():
        info["sys.gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return info


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
