"""Document Q&A facts (pipelines/corpora/docs.py): extractive from their evidence in Markdown, HTML and JSONL, with
hand-checked spans; HTML keeps its lines. Needles: test_needles.py."""

from __future__ import annotations

import json

from pipelines.corpora import docs
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


def test_html_entities_are_decoded_and_lines_kept():
    html = "<h2>T&amp;C</h2>\n<p>a&nbsp;b &lt;x&gt; &eacute;&#x27;&#39; &NewLine;</p>\n<p>end</p>"
    assert docs.html_to_text(html) == "## T&C\na b <x> é'' &NewLine;\nend"


def test_section_and_definition_facts_on_a_hand_read_document():
    """A section's evidence is its heading line and its first paragraph; a wrapped sentence is answered on one line;
    a paragraph whose first sentence is under 20 characters makes no section fact."""
    text = MARKDOWN + "\n## Short\n\nToo short.\n"
    facts = {(f["kind"], f["name"]): f for f in docs.doc_facts(text, "g.md")}
    assert set(facts) == {("section", "Tidewater"), ("definition", "Tidewater"), ("section", "Installation"),
                          ("section", "Queues"), ("definition", "A queue")}
    assert facts[("section", "Installation")]["spans"] == [[5, 5], [7, 7]]
    queues = facts[("section", "Queues")]
    assert queues["spans"] == [[9, 9], [11, 12]] and (queues["start_line"], queues["end_line"]) == (9, 12)
    assert queues["answer"] == "A queue is a named list of jobs that share one priority and one quota."
    assert queues["question"] == 'In g.md, what does the section "Queues" begin by saying?'
    assert facts[("definition", "Tidewater")]["spans"] == [[3, 3]]
    assert docs.answer_in_span(text, 11, 12, queues["answer"])
    assert not docs.answer_in_span(text, 11, 11, queues["answer"])  # the sentence wraps onto line 12
    assert docs.first_sentence("Too short.") is None and docs.first_sentence("x" * 301 + ".") is None
    assert docs.first_sentence("A sentence that\nwraps over lines. More.") == "A sentence that wraps over lines."
