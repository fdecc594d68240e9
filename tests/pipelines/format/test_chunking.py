"""Memory chunks (pipelines/format/chunking.py): cut where the syntax (or a blank line) says, on hand-computed
cases and on real code nobody here wrote; a chunk's ids are its text's tokens at any seam; nothing lost, nothing
repeated; the memory budget keeps every evidence chunk."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest

from pipelines.corpora import syntax
from pipelines.format import chunking
from pipelines.format.chunking import Chunk

# Six lines (0-based 0..5); the file is 21 tokens, a header 8, so chunks of 24 tokens hold 16 of the file's.
SMALL = "def a():\n    x = 1\n\n    return x\ndef b():\n    return 2\n"


def lines_of(chunks: list[Chunk]) -> list[tuple[int, int]]:
    return [(c.start_line, c.end_line) for c in chunks]


def test_a_cut_goes_to_the_highest_priority_line_within_the_budget(tokenizer):
    """Without syntax, a line after a blank line is the preferred cut (`    return x`, line 4); with syntax saying
    `def b():` (0-based line 4) starts a top-level node, the cut moves there. Either way the text is whole."""
    assert len(tokenizer.encode_text(SMALL)) == 21 and len(tokenizer.encode_text(chunking.header("m.py", 0))) == 8
    plain = chunking.chunk_file("m.py", SMALL, tokenizer, chunk_tokens=24)
    assert lines_of(plain) == [(1, 3), (4, 6)]
    by_syntax = chunking.chunk_file("m.py", SMALL, tokenizer, chunk_tokens=24, boundaries={4: 2})
    assert lines_of(by_syntax) == [(1, 4), (5, 6)]
    for chunks in (plain, by_syntax):
        assert [c.text.split("\n", 1)[0] for c in chunks] == ["### m.py [chunk 0]", "### m.py [chunk 1]"]
        assert "".join(c.text.split("\n", 1)[1] for c in chunks) == SMALL
        assert all(c.ids.tolist() == tokenizer.encode_text(c.text) and len(c.ids) <= 24 for c in chunks)
    assert lines_of(chunking.chunk_file("m.py", SMALL, tokenizer, chunk_tokens=30)) == [(1, 6)]  # fits: one chunk
    assert chunking.chunk_file("m.py", "", tokenizer) == []


def test_best_token_cut_prefers_priority_then_lateness():
    cuts = [[3, 5, 9, 12], [5, 12], [9]]  # every cut, priority 1, priority 2
    assert chunking.best_token_cut(0, 10, cuts) == 9  # the priority-2 cut fits
    assert chunking.best_token_cut(0, 8, cuts) == 5  # 9 is past the budget: the latest priority-1 cut
    assert chunking.best_token_cut(0, 40, cuts) == 12  # 9 is in the first quarter (<= 10): too early, 12 is not
    assert chunking.best_token_cut(0, 4, cuts) == 3  # no prioritised cut fits: the latest of any
    assert chunking.best_token_cut(9, 2, cuts) is None  # nothing after the start within the budget


def fake_chunk(path: str, index: int, start: int, end: int) -> Chunk:
    return Chunk(path, index, start, end, chunking.header(path, index), np.zeros(1, dtype=np.int32))


def test_chunks_covering_and_the_memory_budget():
    pool = [fake_chunk("a.py", i, 10 * i + 1, 10 * i + 10) for i in range(4)] + [fake_chunk("b.py", 0, 1, 50)]
    assert [c.index for c in chunking.chunks_covering(pool, "a.py", 10, 11)] == [0, 1]  # a span across a cut
    assert [c.index for c in chunking.chunks_covering(pool, "a.py", 25, 25)] == [2]
    assert chunking.chunks_covering(pool, "c.py", 1, 5) == []
    evidence = [pool[1], pool[3]]
    memory = chunking.select_memory(evidence, pool, max_chunks=4, seed=7)
    assert len(memory) == 4 and all(c in memory for c in evidence) and len(set(map(id, memory))) == 4
    assert memory == chunking.select_memory(evidence, pool, max_chunks=4, seed=7)  # seeded
    orders = {tuple((c.path, c.index) for c in chunking.select_memory(evidence, pool, 5, seed)) for seed in range(8)}
    assert len(orders) > 1 and all(len(o) == 5 for o in orders)  # the evidence moves through the memory
    over = chunking.select_memory(evidence, pool, max_chunks=1, seed=0)  # evidence alone exceeds the budget:
    assert sorted(over, key=lambda c: c.index) == evidence  # all of it stays, no distractor
    assert chunking.chunk_name("a.py", 3) == "### a.py [chunk 3]"


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
