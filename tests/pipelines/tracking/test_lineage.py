"""A run's lineage tags (pipelines/tracking/lineage.py): no environment in them; the data's hash from its manifest, a
listing or the needle settings; the lock's hash and whether this environment matches it, against hand-written locks;
the code's commit and whether the checkout is dirty."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from pipelines.tracking import lineage
from pipelines.tracking.lineage import (LOCKS, data_manifest_hash, environment_lock, installed_versions, lock_drift,
                                        system_info)

ROOT = Path(__file__).resolve().parents[3]
FAKE_TOKEN = "hf_FAKEtoken0123456789abcdef"


def test_system_info_holds_no_environment(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    info = system_info()
    assert FAKE_TOKEN not in str(info) and {"sys.python", "sys.torch", "sys.ray", "sys.mlflow"} <= info.keys()


def test_data_manifest_hash(tmp_path):
    synthetic = data_manifest_hash(None, {"facts": 8})
    assert synthetic.startswith("synthetic:") and synthetic == data_manifest_hash(None, {"facts": 8})
    assert synthetic != data_manifest_hash(None, {"facts": 4})
    (tmp_path / "train").mkdir()
    (tmp_path / "manifest.json").write_text('{"shards": 1}')
    first = data_manifest_hash(str(tmp_path / "train"), {})
    (tmp_path / "manifest.json").write_text('{"shards": 2}')
    assert data_manifest_hash(str(tmp_path / "train"), {}) != first


def test_lock_drift_names_each_difference(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("# comment\nAlpha_Pkg==1.0 \\\n    --hash=sha256:" + "0" * 64 + "\nbeta==2.0\ngamma==3.0\n")
    installed = {"alpha-pkg": "1.0", "beta": "2.1", "delta": "0.1", "awareness": "0.1.0"}
    assert lock_drift(lock, installed) == ["beta 2.0 -> 2.1", "delta not locked -> 0.1", "gamma 3.0 -> missing"]
    assert lock_drift(lock, {"alpha-pkg": "1.0", "beta": "2.0", "gamma": "3.0"}) == []
    assert environment_lock({"torch": "2.13.0"}) == LOCKS["cuda"]
    assert installed_versions()["torch"] == __import__("torch").__version__


def test_lineage_cli_prints_drift_and_rejects_a_missing_lock(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("torch==0.0.1\n")
    out = subprocess.run([sys.executable, "-m", "pipelines.tracking.lineage", "--against", str(lock)],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.startswith(f"{len(lock_drift(lock))} package(s) differ from lock.txt") and "torch 0.0.1 -> " in out
    bad = subprocess.run([sys.executable, "-m", "pipelines.tracking.lineage", "--against", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "is not a file" in bad.stderr and bad.stderr.count("\n") == 1


def test_lock_tags_match_or_name_the_drift_of_a_hand_written_lock(tmp_path, monkeypatch):
    lock = tmp_path / "lock.txt"
    lock.write_text("alpha==1.0 \\\n    --hash=sha256:" + "0" * 64 + "\nbeta==2.0\n")
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()[:16]
    monkeypatch.setattr(lineage, "environment_lock", lambda installed=None: lock)
    monkeypatch.setattr(lineage, "installed_versions", lambda: {"alpha": "1.0", "beta": "2.0", "awareness": "0.1"})
    assert lineage.lock_info() == {"sys.lock": f"lock.txt:{digest}", "sys.lock_match": "true"}
    monkeypatch.setattr(lineage, "installed_versions", lambda: {"alpha": "1.1", "gamma": "3"})
    assert lineage.lock_info() == {"sys.lock": f"lock.txt:{digest}", "sys.lock_match": "false",
                                   "sys.lock_drift": "alpha 1.0 -> 1.1; beta 2.0 -> missing; gamma not locked -> 3"}
    monkeypatch.setattr(lineage, "environment_lock", lambda installed=None: tmp_path / "none.txt")
    assert lineage.lock_info() == {"sys.lock": "missing"}


def test_data_hash_falls_back_to_a_listing_of_the_files(tmp_path):
    split = tmp_path / "corpus" / "train"
    split.mkdir(parents=True)
    (split / "part-0.parquet").write_bytes(b"12345")
    listed = data_manifest_hash(str(split), {})
    assert listed.startswith("listing:") and listed == data_manifest_hash(str(split), {"ignored": 1})
    (split / "part-0.parquet").write_bytes(b"123456")  # another size
    assert data_manifest_hash(str(split), {}) != listed
    assert data_manifest_hash(str(tmp_path / "nowhere"), {}) == "missing"
    (tmp_path / "corpus" / "manifest.json").write_text('{"shards": 1}')  # beside the split: it wins
    assert data_manifest_hash(str(split), {}) == hashlib.sha256(b'{"shards": 1}').hexdigest()[:16]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_git_commit_is_the_head_and_says_dirty(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git(repo, "add", "a.py")
    git(repo, "commit", "-qm", "first")
    monkeypatch.setattr(lineage, "REPOSITORY", repo)
    head = git(repo, "rev-parse", "HEAD")
    (repo / "notes.txt").write_text("untracked files do not count\n")
    assert lineage.git_commit() == head
    (repo / "a.py").write_text("x = 2\n")
    assert lineage.git_commit() == head + "+dirty"
    monkeypatch.setattr(lineage, "REPOSITORY", tmp_path / "not-a-checkout")  # a Ray job's uploaded directory
    (tmp_path / "not-a-checkout").mkdir()
    assert lineage.git_commit() == "unknown"
