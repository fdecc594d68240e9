"""Needles in a haystack of real chunks (RULER's conventions): single, multi-key, multi-value, 2- and 3-hop.

A needle is one sentence inserted as its own line right after a chunk's header, in the chunk at index
`round(depth * (n - 1))` of a memory of n chunks; the row records `depth` and the memory size. Keys are drawn so
that they occur nowhere in the haystack, so each needle stands in the memory exactly once per key. A row's evidence
chunks (and an agentic target's reads) are the chunks of the needles its answer needs (`answer_needles`).
"""

from __future__ import annotations

import random

VARIANTS = ("single", "multikey", "multivalue", "hop2", "hop3")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
WORDS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lagoon", "meadow", "nectar", "onyx", "prairie", "quartz", "raven", "saffron", "tundra", "umber", "violet",
         "willow", "yarrow", "zephyr")


def new_key(rng: random.Random, haystack: str, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(100, 1000)}"
        if key not in taken and key not in haystack:
            taken.add(key)
            return key


def make_needles(variant: str, rng: random.Random, haystack: str) -> tuple[list[str], str, str, list[str]]:
    """(needle sentences, question, answer, keys): the first needle is the one asked about (its depth is recorded);
    the others go to other chunks."""
    taken: set[str] = set()
    number = lambda: str(rng.randrange(1_000_000, 10_000_000))  # noqa: E731
    if variant == "single":
        key, value = new_key(rng, haystack, taken), number()
        return ([f"The special magic number for {key} is: {value}."],
                f"What is the special magic number for {key}?", value, [key])
    if variant == "multikey":
        keys = [new_key(rng, haystack, taken) for _ in range(4)]
        values = [number() for _ in keys]
        needles = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
        return needles, f"What is the special magic number for {keys[0]}?", values[0], keys
    if variant == "multivalue":
        key, values = new_key(rng, haystack, taken), sorted({number() for _ in range(3)})
        needles = [f"One of the special magic numbers for {key} is: {v}." for v in values]
        return needles, f"What are all the special magic numbers for {key}?", ", ".join(values), [key]
    hops = int(variant[-1])
    names = [new_key(rng, haystack, taken).upper().replace("-", "_") for _ in range(hops + 1)]
    value = number()
    needles = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    needles = [needles[-1]] + needles[:-1]  # the asked variable's line first: its depth is the recorded one
    return needles, f"Which value does VAR {names[-1]} hold?", value, names


def answer_needles(variant: str, n: int) -> list[int]:
    """Which of make_needles' n needles the answer needs, in reading order: the asked one (single, multi-key: the
    other keys are distractors), every value (multi-value), or the chain from the asked variable to the value
    (hops: needle 0 sets the asked variable to needle n - 1's, needle k > 1 sets its variable to needle k - 1's,
    needle 1 sets the value)."""
    if variant == "multivalue":
        return list(range(n))
    if variant.startswith("hop"):
        return [0, *range(n - 1, 0, -1)]
    return [0]


def insert_needles(memory_texts: list[str], needles: list[str], depth: float, rng: random.Random) -> list[int]:
    """Puts needle 0 at the chunk of `depth`, the others in distinct other chunks (in place); returns the chunks."""
    n = len(memory_texts)
    first = round(depth * (n - 1))
    others = [i for i in range(n) if i != first]
    rng.shuffle(others)
    where = [first] + [others[k % len(others)] if others else first for k in range(len(needles) - 1)]
    for i, needle in zip(where, needles):
        head, _, body = memory_texts[i].partition("\n")
        memory_texts[i] = f"{head}\n{needle}\n{body}"
    return where
