"""Document Q&A (Markdown, HTML, JSONL) is extractive from its evidence; needles stand once per key at their
recorded depth."""

from __future__ import annotations

import json
import re

from pipelines.corpora import docs
from pipelines.corpora.needles import DEPTHS, VARIANTS
from tests.pipelines.corpora.test_tasks import build_rows

MARKDOWN = """# Tidewater

Tidewater is a scheduler for batch jobs that run on shared clusters.

## Installation

Install the wheel with pip, then run the daemon once to create its state directory.

## Queues

A queue is a named list of jobs that share one priority and one
quota. Jobs leave a queue in arrival order.
"""
HTML = """<html><head><style>p { color: red; }</style></head><body>
<h1>Harbor</h1>
<p>Harbor is the component that stores build artifacts for a week.</p>
<h2>Retention</h2>
<p>Artifacts older than seven days are deleted by a nightly sweep.</p>
</body></html>
"""


def test_doc_facts_are_extractive(tmp_path, tokenizer):
    (tmp_path / "guide.md").write_text(MARKDOWN)
    (tmp_path / "harbor.html").write_text(HTML)
    (tmp_path / "wiki.jsonl").write_text(json.dumps({"text": "# Lantern\n\nLantern is a tracing agent that samples "
                                                     "one request in a thousand.\n"}) + "\n")
    rows = [r for r in build_rows(tmp_path, tokenizer, "docs") if r["task"] == "doc_qa"]
    got = {(r["kind"], r["evidence"]["path"], r["prompt"]): r["answer"] for r in rows}
    answers = set(got.values())
    assert "Install the wheel with pip, then run the daemon once to create its state directory." in answers
    assert "A queue is a named list of jobs that share one priority and one quota." in answers  # wrapped line
    assert "Harbor is the component that stores build artifacts for a week." in answers
    assert "Artifacts older than seven days are deleted by a nightly sweep." in answers
    assert any(path == "wiki.jsonl#L1" for _, path, _ in got)
    for row in rows:
        ev = row["evidence"]
        path = ev["path"].split("#")[0]
        raw = (tmp_path / path).read_text()
        text = (docs.html_to_text(raw) if path.endswith(".html") else
                json.loads(raw.splitlines()[int(ev["path"].split("#L")[1]) - 1])["text"] if "#L" in ev["path"] else raw)
        assert docs.answer_in_span(text, ev["start_line"], ev["end_line"], row["answer"]), row


def test_needles_once_per_key_at_recorded_depth(package_roots, tokenizer):
    rows = [r for r in build_rows(package_roots["click"], tokenizer, "click", needles_per_unit=50)
            if r["task"] == "needle"]
    assert {r["variant"] for r in rows} == set(VARIANTS) and {r["depth"] for r in rows} == set(DEPTHS)
    assert {r["memory_chunks"] for r in rows} == {4, 8, 16}
    for row in rows:
        memory = "".join(row["memory"])
        keys = set(re.findall(r"(?:for|VAR) ([a-z]+-[a-z]+-\d+|[A-Z]+_[A-Z]+_\d+)", memory))
        asked = re.search(r"(?:for|VAR) (\S+?)[?]? (?:hold\?|$)", row["prompt"].strip() + " ")
        assert asked and asked.group(1).rstrip("?") in keys
        for key in keys:
            lines = [l for l in memory.splitlines() if key in l and (l.startswith("VAR") or "magic number" in l)]
            defining = [l for l in lines if l.startswith(f"VAR {key} =") or f"for {key} is" in l]
            expected = 3 if row["variant"] == "multivalue" else 1
            assert len(defining) == expected, (key, lines)
        n = row["memory_chunks"]
        holder = round(row["depth"] * (n - 1))
        first_needle = row["memory"][holder].split("\n")[1]
        assert asked.group(1).rstrip("?") in first_needle  # the asked needle sits in the chunk at `depth`
        if row["variant"] in ("single", "multikey"):
            assert f"is: {row['answer']}." in first_needle
        assert [tokenizer.encode_text(m) for m in row["memory"]] == [list(map(int, m)) for m in row["memory_input_ids"]]


def test_html_entities_are_decoded_and_lines_kept():
    html = "<h2>T&amp;C</h2>\n<p>a&nbsp;b &lt;x&gt; &eacute;&#x27;&#39; &NewLine;</p>\n<p>end</p>"
    assert docs.html_to_text(html) == "## T&C\na b <x> é'' &NewLine;\nend"
