"""Document Q&A facts, extractive: heading -> the section's first sentence, and definitions ("X is a ...").

Markdown is parsed with markdown-it-py (its token `map` gives line spans); plain text and JSONL documents go
through the same parser; HTML is first turned into Markdown-like text line by line (`html_to_text`, lines kept in
place, so evidence line numbers still point into the file). Every answer is a substring of the document text
(whitespace-normalised) in its evidence `spans`; a section's spans also hold its heading line, which the question
names.
"""

from __future__ import annotations

import html
import re

from markdown_it import MarkdownIt

_MD = MarkdownIt("commonmark")
SENTENCE = re.compile(r"(.+?[.!?])(?:\s|$)", re.S)
DEFINITION = re.compile(r"^\**`?([A-Z][\w\-]*(?: [\w\-]+){0,3}?)`?\** (?:is|are) (?:a|an|the) [^.]{8,200}\.")


def html_to_text(source: str) -> str:
    """Tags removed, headings as `#` lines, scripts/styles blanked, entities decoded (no-break spaces as spaces);
    newlines kept, so line numbers survive."""
    source = re.sub(r"(?is)<(script|style)\b.*?</\1>", lambda m: "\n" * m.group(0).count("\n"), source)
    source = re.sub(r"(?is)<h([1-6])\b[^>]*>(.*?)</h\1>",
                    lambda m: "#" * int(m.group(1)) + " " + re.sub(r"<[^>]+>", "", m.group(2)), source)
    text = re.sub(r"(?s)<[^>]*>", lambda m: "\n" * m.group(0).count("\n"), source)
    return re.sub(r"&[#\w]+;?", _entity, text)


def _entity(match: re.Match) -> str:
    """One entity decoded (html.unescape), a no-break space as a space; one that decodes to a line break
    (`&NewLine;`, `&#10;`) stays as written, as it would shift the evidence lines."""
    char = html.unescape(match.group(0))
    return match.group(0) if len(f"{char}.".splitlines()) > 1 else char.replace("\xa0", " ")


def first_sentence(paragraph: str) -> str | None:
    m = SENTENCE.match(" ".join(paragraph.split()))
    sentence = m.group(1) if m else None
    return sentence if sentence and 20 <= len(sentence) <= 300 else None


def doc_facts(text: str, path: str) -> list[dict]:
    """Facts with evidence line spans; a sentence that wraps over lines is answered in its one-line form."""
    out, heading, heading_lines = [], None, None
    tokens = _MD.parse(text)
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open":
            heading = tokens[i + 1].content.strip()
            heading_lines = [tok.map[0] + 1, tok.map[1]] if tok.map else None
        elif tok.type == "paragraph_open" and tok.map:
            paragraph = tokens[i + 1].content
            start, end = tok.map[0] + 1, tok.map[1]
            sentence = first_sentence(paragraph)
            if heading and heading_lines and sentence and tokens[i - 1].type == "heading_close":
                out.append({"kind": "section", "name": heading, "path": path, "start_line": heading_lines[0],
                            "end_line": end, "spans": [heading_lines, [start, end]],
                            "question": f"In {path}, what does the section \"{heading}\" begin by saying?",
                            "answer": sentence})
            m = DEFINITION.match(" ".join(paragraph.split()))
            if m:
                out.append({"kind": "definition", "name": m.group(1), "path": path, "start_line": start,
                            "end_line": end, "spans": [[start, end]],
                            "question": f"According to {path}, what is {m.group(1)}?", "answer": m.group(0)})
    return out


def answer_in_span(text: str, start_line: int, end_line: int, answer: str) -> bool:
    """The extractive check: the answer stands in the span (whitespace-normalised, as wrapped lines are joined)."""
    span = "".join(text.splitlines(keepends=True)[start_line - 1 : end_line])
    return " ".join(answer.split()) in " ".join(span.split())
