"""The commits suite: a fixture repository with tests (a module, its pytest file, a few commits) -> a stage-2 corpus
-> scores. An oracle edit is exact, diff-identical and passes the repository's tests in the sandbox; a wrong edit
fails them; the config's and the corpus's errors; jobs/evaluate.py end to end on a tiny-text export. Agentic
compliance on constructed answers: tests/pipelines/repos/test_agentic.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import AwarenessModel
from pipelines.corpora import build, commits
from pipelines.corpora.build import BuildConfig
from pipelines.corpora.commits import CorpusError, write_parent_tree
from pipelines.corpora.tasks import Stage0Settings
from pipelines.data.memory_modes import MemoryMode, read_system
from pipelines.data.streams import prompt_inputs
from pipelines.evaluate.commits import (CommitsEvaluation, CommitsSuite, commits_metrics, diff_similarity, file_diff,
                                        generate_answers)
from pipelines.evaluate.common import Workers
from pipelines.evaluate.job import EvaluateConfig
from pipelines.format.shards import MANIFEST
from pipelines.format.tokenizer import cached_tokenizer
from pipelines.train.configs.stage import ModelConfig, StageConfig
from pipelines.train.model import build_model
from pipelines.train.recipes.stage import write_system
from tests.pipelines.corpora.test_commits import commit, sh

ROOT = Path(__file__).resolve().parents[3]
BUGGY = "def add(a, b):\n    return a + b\n\n\ndef clamp(x, low, high):\n    return max(low, x)\n"
FIXED = BUGGY.replace("max(low, x)", "max(low, min(x, high))")
TESTS = ("from calc import add, clamp\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
         "def test_clamp():\n    assert clamp(5, 0, 3) == 3\n    assert clamp(-1, 0, 3) == 0\n")
WORKERS = Workers(actors=1, cpus_per_actor=1.0, use_gpu=False, tracking_uri="", out=Path("."))  # only scoring here


def fixture_repository(repo: Path) -> dict[str, str]:
    """calc.py with a bug; its tests (none before them: not tested); a README edit (its tests fail on the bug, with
    the commit's own README too: not tested either); the fix (tested). Returns the commits' shas."""
    repo.mkdir()
    sh(repo, "init", "-q", "-b", "main")
    commit(repo, "Start calc", {"calc.py": BUGGY, "README.md": "# calc\n\nSmall arithmetic helpers.\n"})
    return {"tests": commit(repo, "Add tests for calc", {"test_calc.py": TESTS}),
            "readme": commit(repo, "Document clamp in the README",
                             {"README.md": "# calc\n\nSmall arithmetic helpers: add, clamp.\n"}),
            "fix": commit(repo, "Fix clamp: cap x at high", {"calc.py": FIXED})}


def build_commit_corpus(repo: Path, out: Path) -> Path:
    """jobs/build_corpus.py --stage 2's build without Ray (the same records, rows, shards and manifest; Ray Data only
    spreads repositories over workers), every repository held out (val_fraction 1)."""
    config = BuildConfig(stage=2, sources=[str(repo)], out=str(out), stage0=Stage0Settings(val_fraction=1.0))
    for sub in ("train", "val", "rejects"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    stats = build.build_unit(commits.commit_items(config), out=str(out), make_records=commits.commit_records,
                             make_rows=commits.unit_rows, settings=commits.CommitSettings(val_fraction=1.0),
                             checkpoint=None, row_group_rows=4)
    (out / MANIFEST).write_text(json.dumps(build.make_manifest(config, [json.loads(stats)], 0.0)))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("commits-suite")
    shas = fixture_repository(tmp / "calc")
    return build_commit_corpus(tmp / "calc", tmp / "corpus"), shas


@pytest.fixture(scope="module")
def evaluation(corpus):
    settings = CommitsSuite(corpus=str(corpus[0]), samples=5, timeout_s=60)
    evaluation = CommitsEvaluation(settings, WORKERS)
    yield evaluation
    evaluation.close()


def rows_of(evaluation, sha: str) -> list[dict]:
    return [r for r in evaluation.rows if r["origin"]["commit"] == sha]


def test_an_oracle_edit_is_exact_and_passes_the_tests_a_wrong_one_fails(evaluation, corpus, tmp_path):
    _, shas = corpus
    assert {r["origin"]["commit"] for r in evaluation.rows} == set(shas.values())  # the root commit has no parent
    oracle = [evaluation.score(r, r["target"], [r["target"]] * 5) for r in evaluation.rows]
    assert all(r["exact"] and r["edit_similarity"] == 1.0 for r in oracle)
    assert all(r["agentic"] for r in oracle if r["variant"] == "planning")
    by_commit = {sha: [r for r in oracle if r["commit"] == sha] for sha in shas.values()}
    assert not any(r["has_tests"] or "passed" in r for r in by_commit[shas["tests"]])  # its parent has no tests
    assert all(r["has_tests"] and not r["reference_passes"] for r in by_commit[shas["readme"]])  # clamp is buggy
    for record in by_commit[shas["fix"]]:
        assert record["reference_passes"] and record["passed"] == record["samples"] == 5
    metrics, counts = commits_metrics(oracle)
    assert metrics["commits/exact"] == metrics["commits/pass@1"] == metrics["commits/pass@5"] == 1.0
    assert metrics["commits/edit_similarity"] == metrics["commits/agentic_compliance"] == 1.0
    assert metrics["commits/pass@1/ci95"][1] == 1.0 and metrics["commits/pass@1/ci95"][0] < 1.0
    assert counts == {"commits/rows": 12, "commits/rows_with_tests": 8, "commits/rows_tested": 4,
                      "commits/rows_reference_fails": 4, "commits/rows_without_repository": 0,
                      "commits/planning_rows": 3}

    fix = next(r for r in rows_of(evaluation, shas["fix"]) if r["variant"] == "raw")
    unchanged = evaluation.score(fix, BUGGY, [BUGGY] * 5)  # no edit: the tests still see the bug
    assert not unchanged["exact"] and unchanged["edit_similarity"] == 0.0 and unchanged["passed"] == 0
    near = FIXED.replace("min(x, high)", "min(x, high + 1)")
    wrong = evaluation.score(fix, near, [near, FIXED, near, near, near])  # one sample of five passes
    assert not wrong["exact"] and 0.5 < wrong["edit_similarity"] < 1.0 and wrong["passed"] == 1
    metrics, _ = commits_metrics([unchanged, wrong])
    assert metrics["commits/pass@1"] == pytest.approx(0.1) and metrics["commits/pass@5"] == 0.5
    assert metrics["commits/exact"] == 0.0 and "commits/agentic_compliance" not in metrics

    moved = {**fix, "origin": {**fix["origin"], "repository": str(tmp_path / "moved")}}  # gone since the build
    record = evaluation.score(moved, FIXED, [])
    assert record["exact"] and not record["repository"] and "edit_similarity" not in record and "passed" not in record
    assert commits_metrics([record])[1]["commits/rows_without_repository"] == 1


def test_edit_similarity_compares_the_diffs():
    parent = "a\nb\nc\n"
    assert diff_similarity(parent, "a\nB\nc\n", "a\nB\nc\n") == 1.0
    assert diff_similarity(parent, parent, "a\nB\nc\n") == 0.0  # no edit at all shares nothing with the edit
    assert file_diff(parent, "a\nB\nc\n") == "@@ -1,3 +1,3 @@\n a\n-b\n+B\n c"  # 27 characters
    assert diff_similarity(parent, "a\nX\nc\n", "a\nB\nc\n") == pytest.approx(1 - 1 / 27)  # one substituted


def test_the_parent_tree_comes_from_git_objects_and_runs_no_filter(tmp_path, corpus):
    repo = tmp_path / "r"
    repo.mkdir()
    sh(repo, "init", "-q")
    marker = tmp_path / "FILTER_RAN"
    (repo / ".gitattributes").write_text("*.py filter=evil\n")
    commit(repo, "one", {"run.sh": "echo hi\n", "pkg/mod.py": "X = 1\n"})
    (repo / "run.sh").chmod(0o755)
    (repo / "link.py").symlink_to("/etc/passwd")
    sh(repo, "add", "-A")
    sh(repo, "commit", "-q", "--no-verify", "-m", "exec bit and a symlink")
    parent = sh(repo, "rev-parse", "HEAD")
    child = commit(repo, "two", {"pkg/mod.py": "X = 2\n"})
    sh(repo, "config", "filter.evil.smudge", f"sh -c 'touch {marker}; cat'")
    sh(repo, "config", "filter.evil.clean", f"sh -c 'touch {marker}; cat'")
    files = write_parent_tree({"repository": str(repo), "commit": child, "parent": parent}, tmp_path / "tree")
    assert sorted(files) == [".gitattributes", "pkg/mod.py", "run.sh"]  # not the symlink
    assert (tmp_path / "tree" / "pkg" / "mod.py").read_text() == "X = 1\n"
    assert os.access(tmp_path / "tree" / "run.sh", os.X_OK)
    assert not marker.exists()


def test_config_and_corpus_errors_name_the_fix(tmp_path, corpus):
    problems = " ".join(EvaluateConfig(model=["x"], suite=["commits"]).problems())
    assert "commits.corpus: name a stage-2 corpus" in problems and "jobs/build_corpus.py --stage 2" in problems
    problems = " ".join(EvaluateConfig(model=["x"], suite=["commits"], commits=CommitsSuite(
        corpus=str(tmp_path / "nope"), variants=["bogus"], samples=0)).problems())
    assert "no such directory" in problems and "commits.variants ['bogus'] unknown" in problems
    assert "must be positive" in problems
    assert not EvaluateConfig(model=["x"], suite=["needle"]).problems()  # no corpus needed without the suite

    built, _ = corpus
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(built), str(copy)], check=True)
    with pytest.raises(CorpusError, match="holds no rows"):
        CommitsEvaluation(CommitsSuite(corpus=str(copy), split="train"), WORKERS)
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "stage": 0}))
    with pytest.raises(CorpusError, match="stage-0 corpus, not commits"):
        CommitsEvaluation(CommitsSuite(corpus=str(copy)), WORKERS)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    shard = next((copy / "val").glob("*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(CorpusError, match="(?s)sha256 differs.*rebuild the corpus: python jobs/build_corpus.py "
                                          "--stage 2"):
        CommitsEvaluation(CommitsSuite(corpus=str(copy)), WORKERS)


def text_export(tmp_path: Path, checkpoint_root: Path, memory: str) -> Path:
    """A (random) tiny-text export, as stage 2 writes it (Qwen3's vocabulary, so it reads corpus rows)."""
    config = StageConfig(model=ModelConfig(pair="tiny-text", checkpoint_root=str(checkpoint_root), memory=memory,
                                           decoder="frozen", gca_gate_init=0.3))
    config.data.train_path = "corpus/train"  # a corpus-trained system: no needle task in its system.json
    directory = tmp_path / f"export-{memory}"
    build_model(config.model).save_pretrained(directory)
    write_system(directory, config)
    return directory


def test_systems_read_the_memory_as_they_trained(evaluation, tmp_path, checkpoint_root):
    row = next(r for r in evaluation.rows if r["variant"] == "planning")
    prompt = len([label for label in row["labels"] if label == -100])
    gca = prompt_inputs(row, MemoryMode("gca"))
    assert gca["input_ids"][0].tolist() == row["input_ids"][:prompt]
    assert gca["memory_input_ids"].shape[:2] == (1, len(row["memory_input_ids"]))
    assert gca["memory_attention_mask"].sum() == sum(map(len, row["memory_input_ids"]))
    in_context = prompt_inputs(row, MemoryMode("in_context"))
    assert in_context["input_ids"].shape[1] == prompt + sum(map(len, row["memory_input_ids"]))
    assert set(in_context) == {"input_ids"}
    assert prompt_inputs(row, MemoryMode("none"))["input_ids"][0].tolist() == row["input_ids"][:prompt]

    export = text_export(tmp_path, checkpoint_root, "gca")
    model = AwarenessModel.from_pretrained(export).eval()
    settings = CommitsSuite(corpus="x", max_new_tokens=3, samples=2)
    greedy, samples = generate_answers(model, MemoryMode(read_system(export)["memory"]), row, cached_tokenizer(None),
                                       settings, samples=2, seed=0)
    assert isinstance(greedy, str) and len(samples) == 2 and all(isinstance(s, str) for s in samples)


@pytest.mark.ray
@pytest.mark.slow  # ~1-2 minutes: a corpus build and an evaluation, each on its own Ray
def test_evaluate_commits_end_to_end(tmp_path, checkpoint_root):
    """The documented commands (docs/evaluation.md): jobs/build_corpus.py --stage 2 on the fixture repository, then
    jobs/evaluate.py --suite commits on a random tiny-text export (whose scores are near 0, but counted and written)."""
    shas = fixture_repository(tmp_path / "calc")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    built = subprocess.run([sys.executable, str(ROOT / "jobs" / "build_corpus.py"), "--stage", "2", "--sources",
                            str(tmp_path / "calc"), "--out", str(tmp_path / "corpus"), "--stage0.val_fraction", "1.0",
                            "--num_cpus", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    export = text_export(tmp_path, checkpoint_root, "gca")
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "evaluate.py"), "--model", str(export), "--suite", "commits",
         "--commits.corpus", str(tmp_path / "corpus"), "--commits.max_new_tokens", "4", "--commits.samples", "5",
         "--commits.variants", "raw", "planning", "--out", str(out), "--track", "false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    entry = results["systems"]["gca"]
    assert entry["counts"]["commits/rows"] == 6 and entry["counts"]["commits/rows_tested"] == 2  # the fix
    assert entry["counts"]["commits/planning_rows"] == 3
    for name in ("exact", "pass@1", "pass@5", "agentic_compliance"):
        assert 0 <= entry["metrics"][f"commits/{name}"] <= 1 and len(entry["metrics"][f"commits/{name}/ci95"]) == 2
    assert 0 <= entry["metrics"]["commits/edit_similarity"] <= 1
    assert {r["commit"] for r in results["commits"]["gca"]} == set(shas.values())
    assert any(line.startswith("gca: commits exact ") for line in result.stdout.splitlines())
