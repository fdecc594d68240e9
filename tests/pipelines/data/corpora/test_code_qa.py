"""Code Q&A on real code nobody here wrote (the installed requests and click packages): every answer is re-read
from its evidence span in the file; the memory holds the evidence; token columns match the text columns."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from pipelines.data.corpora import chunking, syntax, tasks
from pipelines.data.corpora.rows import IGNORE
from pipelines.data.corpora.sources import walk_files
from pipelines.data.tokenizer import EOS, SPECIAL_IDS


def build_rows(root: Path, tokenizer, name: str, **kw) -> list[dict]:
    settings = tasks.Stage0Settings(**kw)
    records = [rec for rel in walk_files(root)
               for rec in tasks.file_records({"root": str(root), "path": rel, "source": name, "unit": name},
                                             tokenizer, settings)]
    return list(tasks.unit_rows(records, tokenizer, settings))


def span(root: Path, ev: dict) -> str:
    lines = (root / ev["path"]).read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(lines[ev["start_line"] - 1 : ev["end_line"]])


def verify(root: Path, row: dict) -> bool:
    """The answer, re-read from the file at the evidence span."""
    ev, kind, answer = row["evidence"], row["kind"], row["answer"]
    text = span(root, ev)
    name = row["prompt"].split("`")[1]
    if kind == "defines":
        return answer == ev["path"] and (f"def {name}" in text or f"class {name}" in text or name in text)
    if kind == "constant":
        path, assignment = answer.split(": ", 1)
        return path == ev["path"] and assignment in text
    if kind == "method_of":
        owner_lines = (root / ev["path"]).read_text().splitlines()[: ev["start_line"]]
        owner = next(l for l in reversed(owner_lines) if l.startswith("class "))
        return f"def {name}" in text and owner.startswith(f"class {answer}")
    if kind in ("raises", "callers"):
        return all(item.split(".")[-1] in text for item in answer.split(", "))
    return answer in text  # params, returns


@pytest.fixture(scope="module")
def rows(package_roots, tokenizer):
    return {name: build_rows(root, tokenizer, name) for name, root in package_roots.items()}


def test_every_answer_stands_in_its_evidence(rows, package_roots):
    kinds = Counter()
    for name, root in package_roots.items():
        for row in rows[name]:
            if row["task"] != "code_qa":
                continue
            kinds[row["kind"]] += 1
            assert verify(root, row), (row["prompt"], row["answer"], row["evidence"])
    assert set(kinds) >= {"defines", "params", "method_of", "returns", "raises", "callers", "constant"}, kinds
    assert sum(kinds.values()) > 200


def test_memory_keeps_evidence_within_budget(rows, tokenizer):
    for row in rows["click"]:
        assert 1 <= row["memory_chunks"] <= 16
        ev = row["evidence"]
        headers = [m.split("\n", 1)[0] for m in row["memory"]]
        assert len(set(headers)) == len(headers)  # no chunk twice
        if row["task"] == "code_qa":
            assert any(h.startswith(f"### {ev['path']} [chunk ") for h in headers)
        if row["variant"] == "agentic" or row["kind"] == "agentic":
            read = row["target"].split("<read>")[1].split("</read>")[0]
            assert read in headers  # the <read> action names a chunk that is in the memory


def test_token_columns_match_text(rows, tokenizer):
    for row in rows["requests"][::5]:
        n_prompt = sum(1 for x in row["labels"] if x == IGNORE)
        assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
        assert row["input_ids"][-1] == SPECIAL_IDS[EOS]
        assert tokenizer.decode(row["input_ids"]) == row["prompt"] + row["target"] + EOS
        assert tokenizer.decode(row["input_ids"][:n_prompt]) == row["prompt"]
        assert row["input_ids"][:n_prompt] == tokenizer.encode_text(row["prompt"])  # a served prompt gets these ids
        assert [tokenizer.encode_text(m) for m in row["memory"]] == [list(map(int, m)) for m in row["memory_input_ids"]]
        if "<read>" in row["target"]:
            assert SPECIAL_IDS["<read>"] in row["input_ids"][n_prompt:]


def test_chunks_cover_files_and_cut_at_syntax(package_roots, tokenizer):
    path = package_roots["requests"] / "sessions.py"
    text = path.read_text()
    cuts = syntax.boundaries(syntax.parse("python", text.encode()))
    chunks = chunking.chunk_file("sessions.py", text, tokenizer, boundaries=cuts)
    assert "".join(c.text.split("\n", 1)[1] for c in chunks) == text  # nothing lost, nothing repeated
    assert all(c.ids.tolist() == tokenizer.encode_text(c.text) for c in chunks)
    assert all(len(c.ids) <= 512 for c in chunks) and sum(len(c.ids) for c in chunks) / len(chunks) > 250
    lines = text.splitlines(keepends=True)
    assert all("".join(lines[c.start_line - 1 : c.end_line]) == c.text.split("\n", 1)[1] for c in chunks)
    starts = [c.start_line - 1 for c in chunks[1:]]
    assert sum(cuts.get(s, 0) > 0 for s in starts) >= 0.8 * len(starts)  # mostly at syntax boundaries


@pytest.mark.timeout(60)
@pytest.mark.parametrize("boundaries", [{1: 2}, {}])
def test_long_lines_are_split_and_terminate(tokenizer, boundaries):
    """Dense long lines (generated code: one token per digit, so the size estimate is off 3x): pieces split down
    to lines, then characters, and the loop ends; nothing is lost."""
    digits = "".join(str(i % 10) for i in range(800))
    text = f"x = {digits}\ny = {digits}\n" + "z = '" + "ab cd " * 2000 + "'\n"
    chunks = chunking.chunk_file("gen.py", text, tokenizer, boundaries=boundaries)
    assert "".join(c.text.split("\n", 1)[1] for c in chunks) == text
    assert all(len(c.ids) <= 512 for c in chunks) and len(chunks) > 5
    assert all(tokenizer.decode(c.ids) == c.text for c in chunks)


def test_chunk_ids_are_the_texts_tokens_at_awkward_seams(tokenizer):
    """Line breaks at the start, CRLF, blank runs, trailing spaces, non-NFC text and a multi-byte line longer than a
    chunk: ids always decode to the text; where the cut is at a line (all but the long line), they are exactly
    what re-tokenizing the text gives."""
    import unicodedata

    lines = ["\n", "\r\n", "def f():  \r\n", "    return 'cafe\u0301'\n", "\n\n\n", "x = 1   \n", "  \n"]
    text = "".join(lines * 60) + "s = '" + "日本語のテキスト" * 300 + "'\n" + "".join(lines * 20)
    chunks = chunking.chunk_file("a.py", text, tokenizer, chunk_tokens=64)
    assert "".join(c.text.split("\n", 1)[1] for c in chunks) == unicodedata.normalize("NFC", text)
    assert all(tokenizer.decode(c.ids) == c.text and len(c.ids) <= 64 for c in chunks)
    at_lines = [c for c in chunks if "日本" not in c.text]
    assert len(at_lines) > 10 and all(c.ids.tolist() == tokenizer.encode_text(c.text) for c in at_lines)



@pytest.mark.parametrize("path", ["a.py", "docs/ÜBER café.md", "x/Makefile", "v1.2/3", "weird/name ", "tabs\t",
                                  "it's", "a+b++", "ends.in.dot.", "日本/語.txt", "e\u0301"])
def test_chunk_headers_are_their_texts_tokens_for_any_path(path, tokenizer):
    """Header ids are built from a path part and a cached ` [chunk k]` part; whatever the path ends in, every
    chunk's ids are still what re-tokenizing its text gives."""
    chunks = chunking.chunk_file(path, "x = 1\n\n" * 400, tokenizer, chunk_tokens=64)
    assert len(chunks) > 10
    assert all(c.ids.tolist() == tokenizer.encode_text(c.text) for c in chunks)


LANGS = {
    "web/app.js": "export function addUser(name, age = 3) {\n  return name;\n}\nclass Store {\n  put(key) {}\n}\n",
    "web/types.ts": "interface Shape { area(): number }\nfunction scale(s: Shape, k: number): number {\n  return k;\n}\n",
    "srv/main.go": "package main\n\ntype Server struct{}\n\nfunc (s Server) Serve(addr string, n int) error {\n\treturn nil\n}\n",
    "core/lib.rs": "pub struct Cache { n: usize }\n\npub fn evict(cache: &mut Cache, n: usize) -> bool {\n    true\n}\n",
    "java/Queue.java": "class Queue {\n  int offer(String item, long ttl) {\n    return 0;\n  }\n}\n",
    "c/buf.c": "struct buf { int n; };\n\nstatic int buf_grow(struct buf *b, size_t need) {\n  return 0;\n}\n",
    "cpp/vec.cpp": "class Vec {\n  int n;\n};\n\nint dot(const Vec& a, const Vec& b) {\n  return 0;\n}\n",
}


def test_other_languages_defines_and_params(tmp_path, tokenizer):
    for rel, src in LANGS.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    rows = [r for r in build_rows(tmp_path, tokenizer, "poly") if r["task"] == "code_qa"]
    got = {(r["kind"], r["prompt"].split("`")[1]): r["answer"] for r in rows}
    assert got[("defines", "addUser")] == "web/app.js" and got[("params", "addUser")] == "(name, age = 3)"
    assert got[("params", "scale")] == "(s: Shape, k: number)" and got[("defines", "Shape")] == "web/types.ts"
    assert got[("params", "Serve")] == "(addr string, n int)" and got[("defines", "Server")] == "srv/main.go"
    assert got[("params", "evict")] == "(cache: &mut Cache, n: usize)" and got[("defines", "Cache")] == "core/lib.rs"
    assert got[("params", "offer")] == "(String item, long ttl)" and got[("defines", "Queue")] == "java/Queue.java"
    assert got[("params", "buf_grow")] == "(struct buf *b, size_t need)" and got[("defines", "buf")] == "c/buf.c"
    assert got[("params", "dot")] == "(const Vec& a, const Vec& b)" and got[("defines", "Vec")] == "cpp/vec.cpp"
    for row in rows:
        assert verify(tmp_path, row) if row["kind"] != "defines" else row["answer"] == row["evidence"]["path"]
