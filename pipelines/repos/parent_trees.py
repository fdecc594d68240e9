"""A mined commit's parent tree, rebuilt from git objects and judged by its own tests in the sandbox: one
implementation for stage 3's judge (pipelines.teachers.improve) and the commits suite (pipelines.evaluate.commits)."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

from pipelines.corpora.commits import TEST_FILE, GitError, write_parent_tree
from pipelines.repos.sandbox import run_sandboxed, run_tests


@dataclass(frozen=True)
class ParentTree:
    """One commit's parent tree on disk; `root` None when the repository could not be read (moved, or its objects
    pruned since the corpus was built)."""

    root: Path | None
    has_tests: bool = False


class ParentTrees:
    """Each (repository, parent) tree written once under a private temporary directory (removed with this object, also
    on an error), and each (tree, path, content) test outcome computed once: a commit's variant rows and every
    system's samples share them. `test_command` replaces the default pytest run (pipelines.repos.sandbox.run_tests)."""

    def __init__(self, *, timeout_s: float = 120, memory_mb: int = 2048, test_command: list[str] | None = None):
        self.timeout_s, self.memory_mb, self.test_command = timeout_s, memory_mb, test_command
        self.workdir = Path(tempfile.mkdtemp(prefix="awareness-parent-trees-"))
        self.close = weakref.finalize(self, shutil.rmtree, self.workdir, True)
        self.trees: dict[tuple[str, str], ParentTree] = {}
        self.results: dict[tuple[Path, str, str], bool] = {}

    def tree(self, origin: dict[str, str]) -> ParentTree:
        """origin: a commit row's {repository, commit, parent}."""
        key = (origin["repository"], origin["parent"])
        if key not in self.trees:
            root = self.workdir / f"tree-{len(self.trees)}"
            try:
                files = write_parent_tree(origin, root)
                self.trees[key] = ParentTree(root, any(TEST_FILE.search(f) for f in files))
            except (GitError, OSError):
                shutil.rmtree(root, ignore_errors=True)
                self.trees[key] = ParentTree(None)
        return self.trees[key]

    def passes(self, tree: ParentTree, path: str, content: str) -> bool:
        """Whether the tree's tests pass with `content` as `path` (a tree that could not be read never passes)."""
        if tree.root is None:
            return False
        key = (tree.root, path, content)
        if key not in self.results:
            self.results[key] = self._run(tree.root, path, content)
        return self.results[key]

    def _run(self, root: Path, path: str, content: str) -> bool:
        if self.test_command:
            result = run_sandboxed(root, self.test_command, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                   files={path: content})
            return result.returncode == 0 and not result.timed_out
        return run_tests(root, {path: content}, timeout_s=self.timeout_s, memory_mb=self.memory_mb)[0]
