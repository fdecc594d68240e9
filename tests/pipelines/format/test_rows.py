"""One output row (pipelines/format/rows.py): the prompt's tokens take no loss (IGNORE), the target's and the
closing `<|im_end|>` do; a `<read>` part is the control token, the same string inside text is text; the counts and
the evidence are what the row was given."""

from __future__ import annotations

from pipelines.format.rows import IGNORE, make_row
from pipelines.format.tokenizer import END_READ, EOS, READ, SPECIAL_IDS


def row_of(tokenizer, **overrides) -> dict:
    memory = ["### a.py [chunk 0]\nx = 1\n", "### b.py [chunk 3]\ny = 2\n"]
    kw = dict(task="code_qa", variant="agentic", kind="constant", prompt=["Where is `X` set?", "\n"],
              target=[READ, "### a.py [chunk 0]", END_READ, "a.py: X = 1"], answer="a.py: X = 1", memory=memory,
              memory_ids=[tokenizer.encode_text(m) for m in memory], source="src", unit="src/a",
              evidence=("a.py", 1, 1), evidence_chunks=["### a.py [chunk 0]"], tokenizer=tokenizer)
    return make_row(**(kw | overrides))


def test_labels_ignore_the_prompt_and_keep_the_target_and_eos(tokenizer):
    row = row_of(tokenizer)
    prompt = tokenizer.encode_text("Where is `X` set?\n")  # the parts between tags are one text
    target = ([SPECIAL_IDS[READ]] + tokenizer.encode_text("### a.py [chunk 0]") + [SPECIAL_IDS[END_READ]]
              + tokenizer.encode_text("a.py: X = 1") + [SPECIAL_IDS[EOS]])
    assert row["input_ids"] == prompt + target
    assert row["labels"] == [IGNORE] * len(prompt) + target
    assert IGNORE == -100  # torch's cross_entropy ignore_index
    assert row["prompt"] == "Where is `X` set?\n" and row["target"] == "<read>### a.py [chunk 0]</read>a.py: X = 1"


def test_counts_evidence_and_text_columns(tokenizer):
    row = row_of(tokenizer)
    assert row["memory_chunks"] == 2
    assert row["memory_tokens"] == sum(len(tokenizer.encode_text(m)) for m in row["memory"])
    assert row["evidence"] == {"path": "a.py", "start_line": 1, "end_line": 1}
    assert row["evidence_chunks"] == ["### a.py [chunk 0]"] and row["depth"] is None and row["origin"] is None
    assert (row["task"], row["variant"], row["kind"], row["source"], row["unit"]) == (
        "code_qa", "agentic", "constant", "src", "src/a")


def test_a_tag_written_inside_text_stays_text(tokenizer):
    """Only a part that is exactly `<read>` is the control token: a file that says `<read>` does not act."""
    row = row_of(tokenizer, target=["see <read>x</read>"], answer="see <read>x</read>")
    assert SPECIAL_IDS[READ] not in row["input_ids"]
    n = row["labels"].count(IGNORE)
    assert row["input_ids"][n:] == tokenizer.encode_text("see <read>x</read>") + [SPECIAL_IDS[EOS]]
