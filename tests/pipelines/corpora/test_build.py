"""The Ray Data build end to end: Parquet shards split by repository, every bad input counted by reason and written
to rejects (inputs seen = used + rejected), a manifest that adds up, and a clear error for a missing source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.corpora.build import ROW_SCHEMA, BuildConfig, build_corpus, task_groups
from pipelines.corpora.sources import Limits
from pipelines.corpora.tasks import Stage0Settings, split_of
from pipelines.format.shards import check_split
from tests.pipelines.corpora.test_commits import body, commit, sh

ROOT = Path(__file__).resolve().parents[3]


def bad_inputs(root: Path) -> dict[str, int]:
    """One repository of good files and every stage-0 reject reason; returns the expected reject counts."""
    root.mkdir()
    (root / "good.py").write_text(body(12))
    (root / "notes.md").write_text("# Notes\n\nNotes is a file of sentences that exist for these tests.\n")
    (root / "latin1.py").write_bytes("name = 'café'\n".encode("latin-1"))
    (root / "blob.py").write_bytes(b"x = 1\x00\x01\x02\n")
    (root / "empty.md").write_text("  \n")
    (root / "huge.py").write_text("X = 1\n" * 60_000)  # 360 kB, over the 300 kB limit below
    (root / "dangling.py").symlink_to(root / "missing.py")
    (root / "loop_a.py").symlink_to(root / "loop_b.py")
    (root / "loop_b.py").symlink_to(root / "loop_a.py")
    (root.parent / "secret.py").write_text("TOKEN = 'not for the corpus'\n")
    (root / "escape.py").symlink_to(root.parent / "secret.py")  # a mined repository pointing elsewhere
    (root / "inside.py").symlink_to(root / "good.py")  # inside the source: read like any file
    (root / "docs.jsonl").write_text(
        json.dumps({"text": "# Kettle\n\nKettle is a build cache that lives next to the compiler.\n"}) + "\n"
        + "{not json\n" + json.dumps({"body": "no text field"}) + "\n" + json.dumps({"text": " "}) + "\n")
    return {"non_utf8": 1, "binary": 1, "empty": 2, "huge": 1, "unreadable": 1, "symlink_loop": 2,
            "symlink_outside_source": 1, "malformed_jsonl": 2}


@pytest.fixture(scope="module")
def built(tmp_path_factory, package_roots, ray_local):
    tmp = tmp_path_factory.mktemp("build")
    expected = bad_inputs(tmp / "fixtures")
    sources = [str(tmp / "fixtures"), str(package_roots["requests"]), str(package_roots["click"])]
    names = ["fixtures", "requests", "click"]
    seed = next(s for s in range(100) if len({split_of(n, 0.5, s) for n in names}) == 2)  # both splits used
    config = BuildConfig(stage=0, sources=sources, out=str(tmp / "out"), row_group_rows=16,
                         stage0=Stage0Settings(val_fraction=0.5, seed=seed, limits=Limits(max_file_bytes=300_000)))
    lines = []
    manifest = build_corpus(config, progress=lines.append)
    return tmp / "out", manifest, expected, lines


@pytest.mark.ray
def test_rejects_counted_by_reason_and_nothing_lost(built):
    out, manifest, expected, _ = built
    assert manifest["rejects"] == expected
    seen = manifest["inputs"]
    assert seen["seen"] == seen["used"] + seen["rejected"] and seen["rejected"] == sum(expected.values())
    listed = sum(1 for root in manifest["sources"] for p in Path(root).rglob("*") if p.suffix in (".py", ".md"))
    assert seen["seen"] == listed + 4  # every file, and the 4 JSONL lines instead of their file
    rejects = pq.read_table(out / "rejects").to_pylist()
    assert sorted(r["reason"] for r in rejects) == sorted(k for k, n in expected.items() for _ in range(n))
    assert {r["path"] for r in rejects if r["reason"] == "malformed_jsonl"} == {"docs.jsonl#L2", "docs.jsonl#L3"}
    rows = pq.read_table(out / "train").to_pylist() + pq.read_table(out / "val").to_pylist()
    assert not any("not for the corpus" in m for r in rows for m in r["memory"])  # the outside file was not read


@pytest.mark.ray
def test_shards_split_by_repository_with_the_schema(built):
    out, manifest, _, lines = built
    train, val = manifest["repositories"]["train"], manifest["repositories"]["val"]
    assert train and val and not set(train) & set(val)
    for split, units in (("train", train), ("val", val)):
        table = pq.read_table(out / split)
        assert table.schema.equals(ROW_SCHEMA)
        assert set(table.column("unit").to_pylist()) <= set(units)
        assert table.num_rows == sum(manifest["rows"][split].values())
        checked = check_split(out / split)  # what a stage job checks before it trains on them
        assert checked.rows == table.num_rows and len(checked.paths()) == len(list((out / split).glob("*.parquet")))
        for name, record in checked.shards.items():
            groups = record["row_groups"]
            assert groups and max(groups) <= 16 and sum(groups) == record["rows"]
    assert sorted(manifest["shards"]) == sorted(str(p.relative_to(out)) for p in out.glob("[tv]*/*.parquet"))
    tasks = {t for split in manifest["rows"].values() for t in split}
    assert tasks == {"code_qa", "doc_qa", "needle"}
    assert manifest["tokens"]["train"]["max_input_tokens"] > 0 and len(manifest["content_hash"]) == 64
    assert any("requests" in line for line in lines)  # progress is reported per repository


def test_missing_source_fails_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        build_corpus(BuildConfig(stage=0, sources=[str(tmp_path / "does-not-exist")], out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


@pytest.mark.ray
def test_job_stage2_prints_a_json_summary(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    sh(repo, "init", "-q")
    commit(repo, "start", {"a.py": body(5), "b.py": body(3, "b")})
    commit(repo, "Fix a", {"a.py": body(6)})
    commit(repo, "Touch both", {"a.py": body(7), "b.py": body(4, "b")})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "build_corpus.py"), "--stage", "2", "--sources",
                           str(repo), "--out", str(tmp_path / "out"), "--num_cpus", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["inputs"] == {"seen": 3, "used": 1, "rejected": 2}
    assert summary["rejects"] == {"no_parent": 1, "multi_file": 1}
    assert sum(summary["rows"]["train"].values()) + sum(summary["rows"].get("val", {}).values()) == 4
    assert "[corpus]" in proc.stderr


def test_task_groups_cover_every_repository_once_heaviest_first():
    """Small repositories share a Ray task, a heavy one is a task alone and never split, the heaviest go first."""
    def repo(name, *sizes):
        return [{"unit": name, "path": f"f{i}", "bytes": b} for i, b in enumerate(sizes)]

    units = [repo("big", 6000, 4000), *(repo(f"small{i}", 10 * i + 5) for i in range(40)), repo("mid", 2000, 1000)]
    groups = task_groups(units, cpus=2)
    names = [[names[0]["unit"] for names in group] for group in groups]
    assert sorted(n for group in names for n in group) == sorted(u[0]["unit"] for u in units)  # each once
    assert names[0] == ["big"] and names[1] == ["mid"]
    assert 4 <= len(groups) <= 8  # about 4 tasks per CPU: 2 alone, the 40 small ones in a few
    weights = [sum(i["bytes"] for names in group for i in names) for group in groups]
    assert max(weights[2:]) < weights[0]
    commits = [[{"unit": f"repo{i}", "commit": str(k)} for k in range(i + 1)] for i in range(3)]  # no sizes: counts
    assert [[n[0]["unit"] for n in g] for g in task_groups(commits, cpus=4)] == [["repo2"], ["repo1"], ["repo0"]]
