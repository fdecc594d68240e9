"""Reading source files safely: every file is either text we use or a reject with a reason.

Reasons (the manifest counts them; `rejects/` holds one row each): `unreadable`, `symlink_loop`,
`symlink_outside_source`, `empty`, `huge`, `binary`, `non_utf8`, `malformed_jsonl`, `broken_git_object`, plus the
commit filter's reasons (pipelines.corpora.commits).
Nothing here executes or imports anything from a source tree.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

CODE_EXTENSIONS = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript",
    ".jsx": "javascript", ".ts": "typescript", ".tsx": "tsx", ".go": "go", ".rs": "rust", ".java": "java",
    ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp", ".hpp": "cpp", ".hh": "cpp",
}
DOC_EXTENSIONS = {".md": "markdown", ".markdown": "markdown", ".rst": "text", ".txt": "text", ".html": "html",
                  ".htm": "html", ".jsonl": "jsonl"}
SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", "node_modules", ".venv", "venv", ".tox", ".mypy_cache",
             ".pytest_cache", "build", "dist", ".eggs"}
REASONS = ("unreadable", "symlink_loop", "symlink_outside_source", "empty", "huge", "binary", "non_utf8",
           "malformed_jsonl", "broken_git_object")


@dataclass(frozen=True)
class Limits:
    max_file_bytes: int = 1_000_000  # above: `huge` (generated or data files, not source to learn from)
    text_field: str = "text"  # the JSONL field holding a document's text


def kind_of(path: str) -> str | None:
    """`python`, `markdown`, ... or None for files we do not read."""
    suffix = os.path.splitext(path)[1].lower()
    return CODE_EXTENSIONS.get(suffix) or DOC_EXTENSIONS.get(suffix)


def check_sources(paths: list[str]) -> list[Path]:
    """Every source must exist before any work starts; one message lists every problem."""
    missing = [p for p in paths if not os.path.exists(p)]
    if not paths:
        raise ValueError("no sources given: pass --sources with at least one directory, file or git repository")
    if missing:
        raise FileNotFoundError(f"source path(s) do not exist: {', '.join(missing)}; pass existing directories, "
                                "files or git repositories to --sources")
    return [Path(p).resolve() for p in paths]


def walk_files(root: Path) -> list[str]:
    """Relative paths of candidate files under root (sorted; symlinks listed, judged when read).

    Only names: contents are read by the workers."""
    if root.is_file():
        return [root.name] if kind_of(root.name) else []
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            if kind_of(name):
                out.append(name if rel == "." else os.path.join(rel, name))
    return out


def size_or_zero(path: Path) -> int:
    """For scheduling only (the worker judges the file): the listed entry's own size, 0 if it cannot be read."""
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def read_text(path: str, limits: Limits, root: str | None = None) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason). With `root`, a symlink that resolves outside it is rejected: a mined
    repository must not make the build read (and publish in its shards) files elsewhere on the machine."""
    try:
        os.stat(path)  # follows symlinks: a loop raises ELOOP
        if root is not None and os.path.islink(path) and os.path.isdir(root):  # walks never enter linked dirs
            real, base = os.path.realpath(path), os.path.realpath(root)
            if os.path.commonpath([real, base]) != base:
                return None, "symlink_outside_source"
        if os.path.getsize(path) > limits.max_file_bytes:
            return None, "huge"
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return None, "symlink_loop" if e.errno == errno.ELOOP else "unreadable"
    return decode_bytes(data)


def decode_bytes(data: bytes) -> tuple[str | None, str | None]:
    if not data.strip():
        return None, "empty"
    if b"\x00" in data[:8192]:
        return None, "binary"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, "non_utf8"


def jsonl_documents(text: str, field: str) -> list[tuple[int, str | None, str | None]]:
    """(line number, document text, reject reason) for each non-blank JSONL line."""
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            value = doc[field] if isinstance(doc, dict) else None
        except (json.JSONDecodeError, KeyError):
            value = None
        if not isinstance(value, str):
            out.append((n, None, "malformed_jsonl"))
        elif not value.strip():
            out.append((n, None, "empty"))
        else:
            out.append((n, value, None))
    return out


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def reject(source: str, path: str, reason: str, detail: str = "") -> dict:
    """A row of `rejects/`."""
    return {"source": source, "path": path, "reason": reason, "detail": detail[:500]}
