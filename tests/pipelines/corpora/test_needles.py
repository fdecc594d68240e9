"""Needles in a haystack of real chunks (pipelines/corpora/needles.py): each variant's sentences, question and answer
by hand; the chain a hop question needs; needle 0 at the recorded depth, the others in other chunks; and in built rows
(real code), each key once per memory at the recorded depth."""

from __future__ import annotations

import random
import re

import pytest

from pipelines.corpora import needles
from pipelines.corpora.needles import DEPTHS, VARIANTS
from tests.pipelines.corpora.test_tasks import build_rows


def test_single_and_multivalue_needles_state_their_answer():
    sentences, question, answer, keys = needles.make_needles("single", random.Random(0), "")
    (key,) = keys
    assert sentences == [f"The special magic number for {key} is: {answer}."]
    assert question == f"What is the special magic number for {key}?" and re.fullmatch(r"\d{7}", answer)
    sentences, question, answer, (key,) = needles.make_needles("multivalue", random.Random(1), "")
    values = answer.split(", ")
    assert values == sorted(values) and len(sentences) == len(values)  # 3 draws, duplicates merged
    assert sentences == [f"One of the special magic numbers for {key} is: {v}." for v in values]
    sentences, question, answer, keys = needles.make_needles("multikey", random.Random(2), "")
    assert len(keys) == len(set(keys)) == 4 and f"for {keys[0]} is: {answer}." in sentences[0]
    assert question == f"What is the special magic number for {keys[0]}?"


@pytest.mark.parametrize("variant", ["hop2", "hop3"])
def test_a_hop_question_follows_the_needles_answer_needles_names(variant):
    """Reading the needles answer_needles picks, in its order, walks from the asked variable to the value."""
    sentences, question, answer, names = needles.make_needles(variant, random.Random(3), "")
    hops = int(variant[-1])
    assert len(sentences) == len(names) == hops + 1
    order = needles.answer_needles(variant, len(sentences))
    assert order == [0, *range(hops, 0, -1)]  # hop3: [0, 3, 2, 1]
    wanted = re.search(r"VAR (\S+) hold\?", question).group(1)
    assert wanted == names[-1]
    for i in order:
        assigned, value = re.fullmatch(r"VAR (\S+) = (.+)\.", sentences[i]).groups()
        assert assigned == wanted
        wanted = value.removeprefix("VAR ")
    assert wanted == answer  # the last needle read holds the number
    assert needles.answer_needles("multivalue", 3) == [0, 1, 2] and needles.answer_needles("multikey", 4) == [0]


def test_keys_are_never_in_the_haystack():
    first = needles.new_key(random.Random(5), "", set())
    assert re.fullmatch(r"[a-z]+-[a-z]+-\d{3}", first)
    again = needles.new_key(random.Random(5), f"... {first} ...", set())  # the same draw, now in the haystack
    assert again != first and needles.new_key(random.Random(5), "", {first}) != first


def test_needle_zero_goes_to_the_chunk_of_its_depth_and_the_others_elsewhere():
    texts = [f"### a.py [chunk {i}]\nbody {i}\n" for i in range(5)]
    where = needles.insert_needles(texts, ["N0", "N1", "N2"], 0.5, random.Random(0))
    assert where[0] == 2 and len(set(where)) == 3  # round(0.5 * 4); distinct chunks
    for i, text in enumerate(texts):
        head, line, *_ = text.split("\n")
        assert head == f"### a.py [chunk {i}]"  # the header stays first: a <read> still names the chunk
        assert line == (f"N{where.index(i)}" if i in where else f"body {i}")
    assert needles.insert_needles(["### b [chunk 0]\nx\n"], ["A", "B"], 1.0, random.Random(0)) == [0, 0]


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
            lines = [line for line in memory.splitlines()
                     if key in line and (line.startswith("VAR") or "magic number" in line)]
            defining = [line for line in lines if line.startswith(f"VAR {key} =") or f"for {key} is" in line]
            expected = 3 if row["variant"] == "multivalue" else 1
            assert len(defining) == expected, (key, lines)
        n = row["memory_chunks"]
        holder = round(row["depth"] * (n - 1))
        first_needle = row["memory"][holder].split("\n")[1]
        assert asked.group(1).rstrip("?") in first_needle  # the asked needle sits in the chunk at `depth`
        if row["variant"] in ("single", "multikey"):
            assert f"is: {row['answer']}." in first_needle
        assert [tokenizer.encode_text(m) for m in row["memory"]] == [list(map(int, m)) for m in row["memory_input_ids"]]
