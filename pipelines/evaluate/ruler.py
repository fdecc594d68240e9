"""RULER-style needle probes (Hsieh et al. 2024) in the needle vocabulary stage 0 trains on, generated offline and
deterministically per (variant, memory size, seed, index), so every system is asked exactly the same questions.

Variants: `single` (the training task at a new memory size), `multi_key` (more key -> value needles, one asked per
question: the others are distractors that look like the answer), `multi_value` (the asked key holds two values;
both must be answered), `multi_query` (one question names two keys; both values must be answered), and
`variable_tracking` (2-3 hops: `ka = kb ; kb = d d d ;`, asked `ka`). Memory size counts chunks; facts are packed into fact-sized slots
as stage 0 packs them (a shorter fact is followed by filler), so `single` at 1x is the training distribution and the
memory's size does not depend on its contents. Scoring is RULER's string match: a question's references must appear in the generated answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipelines.data.synthetic_needles import BOS, EQ, FILLER, KEYS, SEP, VALUES, NeedleSpec

VARIANTS = ("single", "multi_key", "multi_value", "multi_query", "variable_tracking")


@dataclass
class Probe:
    """One memory (chunks, chunk_len) and its questions, each with the token strings its answer must contain, where
    (as a fraction of the memory) the fact holding the answer starts, and the chunks its evidence lies in (every fact
    the answer needs: both values, both keys, every hop)."""

    memory: np.ndarray
    questions: list[list[int]]
    references: list[list[list[int]]]
    depth: list[float]
    evidence: list[list[int]]


def memory_chunks(spec: NeedleSpec, multiplier: int) -> int:
    """A memory `multiplier` times the training memory's size, in chunks."""
    return spec.chunks * multiplier


def make_probe(variant: str, spec: NeedleSpec, multiplier: int, seed: int, index: int, hops: int = 2) -> Probe:
    if variant not in VARIANTS:
        raise ValueError(f"unknown needle variant {variant!r}; choose from {VARIANTS}")
    rng = np.random.default_rng([seed, VARIANTS.index(variant), multiplier, hops, index])
    chunks = memory_chunks(spec, multiplier)
    slots = chunks * spec.facts_per_chunk
    questions = spec.questions
    digits = lambda n: [rng.choice(np.array(VALUES[: spec.value_range]), size=spec.value_digits).tolist()
                        for _ in range(n)]  # noqa: E731
    if variant == "variable_tracking":
        questions = min(questions, slots // hops)  # 3 hops in a 1x memory: as many chains as fit
        keys = rng.choice(np.array(KEYS), size=questions * hops, replace=False).tolist()
        chains = [keys[q * hops : (q + 1) * hops] for q in range(questions)]
        values = digits(questions)
        facts = [[a, EQ, b, SEP] for chain in chains for a, b in zip(chain, chain[1:])]
        facts += [[chain[-1], EQ, *v, SEP] for chain, v in zip(chains, values, strict=True)]
        asked = [[BOS, chain[0]] for chain in chains]
        refs = [[v] for v in values]
        answer_fact = [len(facts) - questions + q for q in range(questions)]
        hops_before = hops - 1
        needed = [[q * hops_before + h for h in range(hops_before)] + [answer_fact[q]] for q in range(questions)]
    else:
        n_facts = min(spec.facts * (multiplier if variant == "multi_key" else 1), len(KEYS), slots // 2)
        keys = rng.choice(np.array(KEYS), size=n_facts, replace=False).tolist()
        values = digits(n_facts)
        facts = [[k, EQ, *v, SEP] for k, v in zip(keys, values, strict=True)]
        order = rng.choice(n_facts, size=min(questions * (2 if variant == "multi_query" else 1), n_facts), replace=False)
        if variant == "multi_query":
            pairs = order.reshape(-1, 2).tolist()
            asked = [[BOS, keys[a], keys[b]] for a, b in pairs]
            refs = [[values[a], values[b]] for a, b in pairs]
            answer_fact = [a for a, _ in pairs]
            needed = [list(pair) for pair in pairs]
        else:
            asked = [[BOS, keys[f]] for f in order.tolist()]
            refs = [[values[f]] for f in order.tolist()]
            answer_fact = order.tolist()
            needed = [[f] for f in answer_fact]
            if variant == "multi_value":  # a second value for each asked key, somewhere else in the memory
                second = digits(len(order))
                needed = [[f, len(facts) + q] for q, f in enumerate(answer_fact)]
                facts += [[keys[f], EQ, *v, SEP] for f, v in zip(order.tolist(), second, strict=True)]
                refs = [[values[f], s] for f, s in zip(order.tolist(), second, strict=True)]
    memory, starts = place(facts, spec, chunks, rng)
    return Probe(memory=memory, questions=asked, references=refs,
                 depth=[starts[f] / (chunks * spec.chunk_len) for f in answer_fact],
                 evidence=[sorted({starts[f] // spec.chunk_len for f in facts_needed}) for facts_needed in needed])


def place(facts: list[list[int]], spec: NeedleSpec, chunks: int, rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """As stage 0 builds a memory (synthetic_needles.make_example): the facts shuffled and packed slot after slot
    into randomly chosen chunks among `chunks`, filler everywhere else; each fact's start position."""
    fact_chunks = -(-len(facts) // spec.facts_per_chunk)
    if fact_chunks > chunks:
        raise ValueError(f"{len(facts)} facts do not fit in {chunks} chunks of {spec.facts_per_chunk} slots")
    memory = rng.choice(np.array(FILLER), size=(chunks, spec.chunk_len))
    chunk_of_slot = np.sort(rng.choice(chunks, size=fact_chunks, replace=False))
    starts = [0] * len(facts)
    for n, fact in enumerate(rng.permutation(len(facts)).tolist()):
        chunk = int(chunk_of_slot[n // spec.facts_per_chunk])
        offset = (n % spec.facts_per_chunk) * spec.fact_len
        memory[chunk, offset : offset + len(facts[fact])] = facts[fact]
        starts[fact] = chunk * spec.chunk_len + offset
    return memory, starts


def as_text(tokens: list[int]) -> str:
    """Token ids as space-separated words with a space at both ends, so a reference matches whole tokens only."""
    return " " + " ".join(str(t) for t in tokens) + " "
