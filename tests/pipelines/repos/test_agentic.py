"""The agentic answer format (pipelines/repos/agentic.py), shared by the commits suite and stage 3: a trajectory read
from control tokens (never from text that spells the tags), its round trip through the corpus's target parts, what
an answer edits, and compliance of text answers (plan, then reads of real chunks, one of the edited file, then the
edit)."""

from __future__ import annotations

import pytest

from pipelines.format.tokenizer import (EDIT, END_EDIT, END_PLAN, END_READ, EOS, PLAN, READ, SPECIAL_IDS, VOCAB_SIZE,
                                         cached_tokenizer)
from pipelines.repos.agentic import (FormatError, Trajectory, agentic_compliance, chunk_names, decode, edited_file,
                                     parse_trajectory, same_file, trajectory_parts)

TOKENIZER = cached_tokenizer(None)
CALC = "### calc.py [chunk 0]"
FIXED = "def add(a, b):\n    return a + b\n\n\ndef clamp(x, low, high):\n    return max(low, min(x, high))\n"


def candidate(plan: str = "Fix clamp.", reads: tuple[str, ...] = (CALC,), edit: str = FIXED) -> list[int]:
    parts = [PLAN, plan, END_PLAN, *(p for r in reads for p in (READ, r, END_READ)), EDIT, edit, END_EDIT]
    return TOKENIZER.encode_parts(parts) + [SPECIAL_IDS[EOS]]


def test_the_format_is_read_from_control_tokens():
    assert parse_trajectory(candidate(reads=(CALC, "### README.md [chunk 0]")), TOKENIZER).reads == [
        CALC, "### README.md [chunk 0]"]
    cases = {
        "cut at max_new_tokens": candidate()[:-1],
        "empty plan": candidate(plan="  "),
        "not <plan>": TOKENIZER.encode_parts([PLAN, "Fix.", END_PLAN, EDIT, FIXED, END_EDIT]) + [SPECIAL_IDS[EOS]],
        "text outside": candidate()[:-1] + TOKENIZER.encode_text(" and more") + [SPECIAL_IDS[EOS]],
    }
    for expected, ids in cases.items():
        with pytest.raises(FormatError, match=expected):
            parse_trajectory(ids, TOKENIZER)
    # the tags written as text (what a file may contain) are not tags
    spelled = TOKENIZER.encode_text(f"<plan>Fix.</plan><read>{CALC}</read><edit>{FIXED}</edit>")
    with pytest.raises(FormatError, match="no tags"):
        parse_trajectory(spelled + [SPECIAL_IDS[EOS]], TOKENIZER)


def test_agentic_compliance_needs_plan_read_edit_in_order_and_a_real_chunk():
    real = ["### calc.py [chunk 0]", "### README.md [chunk 0]"]
    right = "<plan>1. Read calc.py. 2. Fix clamp.</plan><read>### calc.py [chunk 0]</read><edit>x = 1\n</edit>"
    assert agentic_compliance(right, real, "calc.py")
    assert agentic_compliance(right.replace("</plan>", "</plan><read>### README.md [chunk 0]</read>"), real, "calc.py")
    assert not agentic_compliance(right, real, "other.py")  # it read, but not the file it edits
    made_up = right.replace("calc.py [chunk 0]", "calc.py [chunk 7]")
    assert not agentic_compliance(made_up, real, "calc.py")
    edit_first = "<edit>x = 1\n</edit><plan>Fix.</plan><read>### calc.py [chunk 0]</read>"
    assert not agentic_compliance(edit_first, real, "calc.py")
    read_first = "<read>### calc.py [chunk 0]</read><plan>Fix.</plan><edit>x = 1\n</edit>"
    assert not agentic_compliance(read_first, real, "calc.py")
    assert not agentic_compliance(right.replace("<read>### calc.py [chunk 0]</read>", ""), real, "calc.py")
    assert not agentic_compliance("<plan> </plan><read>### calc.py [chunk 0]</read><edit></edit>", real, "calc.py")
    assert not agentic_compliance(right + "trailing words", real, "calc.py")
    assert edited_file(right) == "x = 1\n" and edited_file("x = 2\n") == "x = 2\n"


def test_a_trajectory_round_trips_through_its_target_parts():
    trajectory = Trajectory(plan="1. Read calc.py.\n2. Cap x at high.", reads=[CALC, "### README.md [chunk 0]"],
                            edit=FIXED)
    ids = TOKENIZER.encode_parts(trajectory_parts(trajectory)) + [SPECIAL_IDS[EOS]]
    assert parse_trajectory(ids, TOKENIZER) == trajectory
    assert parse_trajectory(ids + TOKENIZER.encode_text("after the end"), TOKENIZER) == trajectory  # EOS ends it
    spaced = TOKENIZER.encode_parts([PLAN, "Fix.", END_PLAN, "\n", READ, f" {CALC} ", END_READ, "\n", EDIT, "x\n",
                                     END_EDIT, "\n"]) + [SPECIAL_IDS[EOS]]
    assert parse_trajectory(spaced, TOKENIZER) == Trajectory("Fix.", [CALC], "x\n")  # reads stripped
    assert trajectory_parts(trajectory)[:3] == [PLAN, trajectory.plan, END_PLAN]


def test_decode_stops_at_eos_and_drops_ids_past_the_vocabulary():
    spare = [VOCAB_SIZE, VOCAB_SIZE + 7]  # a decoder's spare embedding rows
    ids = TOKENIZER.encode_text("x = 1") + spare + [SPECIAL_IDS[EOS]] + TOKENIZER.encode_text("y")
    assert decode(TOKENIZER, ids) == "x = 1"
    assert decode(TOKENIZER, [SPECIAL_IDS[READ]] + TOKENIZER.encode_text("a")) == "<read>a"


def test_what_an_answer_edits():
    assert edited_file("<plan>p</plan><read>r</read><edit>new\n</edit>") == "new\n"
    assert edited_file("<edit>first</edit><edit>second</edit>") == "second"  # the last edit
    assert edited_file("<plan>p</plan><edit>cut at the token limit") == "cut at the token limit"
    assert edited_file("the file itself\n") == "the file itself\n"  # raw, hinted and imperative answers
    assert same_file("caf\u00e9\n", "cafe\u0301\n") and not same_file("a\n", "a")
    assert chunk_names([f"{CALC}\nx = 1\n", "### README.md [chunk 2] \n# calc\n"]) == [CALC, "### README.md [chunk 2]"]
