"""A commit's parent tree (pipelines/repos/parent_trees.py) on a two-commit repository made here: written once from
git objects, whether it has tests, each (tree, path, content) judged once, and a repository that cannot be read.
(The judges that use it: tests/pipelines/teachers/test_improve.py and tests/pipelines/evaluate/test_commits.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipelines.repos.parent_trees import ParentTree, ParentTrees

# the tree's "test suite": passes when value.py holds 2 (run confined, in the tree, by run_sandboxed)
CHECK = [sys.executable, "-c", "import sys; sys.exit(0 if open('value.py').read().strip() == 'VALUE = 2' else 1)"]


def git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()


@pytest.fixture
def origin(tmp_path):
    """{repository, commit, parent}: the parent holds value.py and tests/test_value.py, the commit changes value.py."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "value.py").write_text("VALUE = 1\n")
    (repo / "tests" / "test_value.py").write_text("from value import VALUE\n")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "parent")
    parent = git(repo, "rev-parse", "HEAD")
    (repo / "value.py").write_text("VALUE = 2\n")
    git(repo, "commit", "-qam", "fix")
    return {"repository": str(repo), "commit": git(repo, "rev-parse", "HEAD"), "parent": parent}


def test_the_parent_tree_is_written_once_from_git_objects(origin):
    trees = ParentTrees(test_command=CHECK)
    tree = trees.tree(origin)
    assert tree.has_tests and (tree.root / "value.py").read_text() == "VALUE = 1\n"  # the parent's, not the commit's
    assert sorted(p.name for p in tree.root.rglob("*") if p.is_file()) == ["test_value.py", "value.py"]
    assert trees.tree(dict(origin, commit="another commit, same parent")) is tree
    trees.close()
    assert not tree.root.exists()


def test_each_edit_is_judged_once(origin, monkeypatch):
    trees = ParentTrees(test_command=CHECK, timeout_s=60)
    tree = trees.tree(origin)
    assert trees.passes(tree, "value.py", "VALUE = 2\n")
    assert not trees.passes(tree, "value.py", "VALUE = 3\n")
    assert (tree.root / "value.py").read_text() == "VALUE = 1\n"  # the edit went to the sandbox's copy only
    monkeypatch.setattr(trees, "_run", lambda *args: pytest.fail("judged twice"))
    assert trees.passes(tree, "value.py", "VALUE = 2\n") and not trees.passes(tree, "value.py", "VALUE = 3\n")
    trees.close()


def test_an_unreadable_repository_gives_a_tree_that_never_passes(origin, tmp_path):
    trees = ParentTrees(test_command=CHECK)
    gone = trees.tree(dict(origin, repository=str(tmp_path / "moved")))
    assert gone == ParentTree(None)
    pruned = trees.tree(dict(origin, parent="0" * 40))
    assert pruned.root is None
    assert not trees.passes(gone, "value.py", "VALUE = 2\n")
    trees.close()
