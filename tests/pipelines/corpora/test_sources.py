"""Reading source files safely (pipelines/corpora/sources.py), without Ray: which files are listed, and every file is
either its text or one reject reason (the build's end-to-end counts: test_build.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipelines.corpora import sources
from pipelines.corpora.sources import Limits, read_text


def test_kinds_and_the_walk_skip_what_is_not_source(tmp_path):
    assert [sources.kind_of(p) for p in ("a.py", "B.PY", "x.tsx", "n.md", "d.jsonl", "p.html", "img.png", "Makefile")] \
        == ["python", "python", "tsx", "markdown", "jsonl", "html", None, None]
    for rel in ("a.py", "pkg/b.go", "pkg/.hidden/c.py", ".git/d.py", "node_modules/e.js", "build/f.py",
                "pkg/__pycache__/g.py", "docs/readme.md", "logo.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert sources.walk_files(tmp_path) == ["a.py", os.path.join("docs", "readme.md"), os.path.join("pkg", "b.go")]
    assert sources.walk_files(tmp_path / "a.py") == ["a.py"] and sources.walk_files(tmp_path / "logo.png") == []


def test_each_unusable_file_gets_its_reason(tmp_path):
    files = {"ok.py": "x = 1\n".encode(), "empty.py": b" \n\t\n", "binary.py": b"x = 1\x00\x01",
             "latin1.py": "s = 'caf\u00e9'\n".encode("latin-1"), "huge.py": b"x = 1\n" * 100}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    limits = Limits(max_file_bytes=500)
    got = {name: read_text(str(tmp_path / name), limits) for name in files}
    assert got == {"ok.py": ("x = 1\n", None), "empty.py": (None, "empty"), "binary.py": (None, "binary"),
                   "latin1.py": (None, "non_utf8"), "huge.py": (None, "huge")}
    (tmp_path / "dangling.py").symlink_to(tmp_path / "missing.py")
    (tmp_path / "loop_a.py").symlink_to(tmp_path / "loop_b.py")
    (tmp_path / "loop_b.py").symlink_to(tmp_path / "loop_a.py")
    assert read_text(str(tmp_path / "dangling.py"), limits) == (None, "unreadable")
    assert read_text(str(tmp_path / "loop_a.py"), limits) == (None, "symlink_loop")


def test_a_symlink_out_of_the_source_is_refused_and_one_inside_is_read(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (tmp_path / "secret.py").write_text("TOKEN = 'not for the corpus'\n")
    (root / "good.py").write_text("x = 1\n")
    (root / "escape.py").symlink_to(tmp_path / "secret.py")
    (root / "inside.py").symlink_to(root / "good.py")
    assert read_text(str(root / "escape.py"), Limits(), str(root)) == (None, "symlink_outside_source")
    assert read_text(str(root / "inside.py"), Limits(), str(root)) == ("x = 1\n", None)
    assert read_text(str(root / "escape.py"), Limits())[0] is not None  # without a root, nothing to leave


def test_jsonl_documents_number_their_lines_and_name_bad_ones():
    text = "\n".join([json.dumps({"text": "# A\n\nfirst"}), "", "{not json", json.dumps({"body": "x"}),
                      json.dumps({"text": "  "}), json.dumps(["text"]), json.dumps({"text": 3}),
                      json.dumps({"text": "last"})])
    assert sources.jsonl_documents(text, "text") == [
        (1, "# A\n\nfirst", None), (3, None, "malformed_jsonl"), (4, None, "malformed_jsonl"), (5, None, "empty"),
        (6, None, "malformed_jsonl"), (7, None, "malformed_jsonl"), (8, "last", None)]
    assert sources.jsonl_documents(json.dumps({"body": "b"}), "body") == [(1, "b", None)]


def test_missing_sources_are_named_together(tmp_path):
    with pytest.raises(ValueError, match="no sources given: pass --sources"):
        sources.check_sources([])
    with pytest.raises(FileNotFoundError, match=f"do not exist: {tmp_path / 'a'}, {tmp_path / 'b'}; pass existing"):
        sources.check_sources([str(tmp_path / "a"), str(tmp_path), str(tmp_path / "b")])
    assert sources.check_sources([str(tmp_path)]) == [Path(tmp_path).resolve()]


def test_rejects_and_hashes():
    row = sources.reject("src", "a.py", "binary", "x" * 900)
    assert row == {"source": "src", "path": "a.py", "reason": "binary", "detail": "x" * 500}
    assert sources.content_hash("a") == "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"  # sha256


def test_every_reason_read_text_gives_is_listed_in_reasons():
    given = {"unreadable", "symlink_loop", "empty", "huge", "binary", "non_utf8", "symlink_outside_source"}
    assert given <= set(sources.REASONS)
