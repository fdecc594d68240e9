"""Synthetic key -> value needles for stage 0 in token-id space, deterministic per example index.

A memory holds `facts` facts `key = d1 d2 d3 ;`, shuffled and packed into fact chunks, plus `distractors` chunks
of filler; the chunks come in random order, so each fact sits at a recorded depth. `questions` of the facts are
asked as `BOS key` with target `d1 d2 d3 EOS`. The first digit is predicted at the key token itself, so the GCA
query that finds the fact is the key's own state: asked as `BOS key =`, the decoder must first learn to carry the
key one position on, and a tiny random pair sat on the chance plateau about twice as long (both measured in
single-process runs of the stage-0 model). Example i is drawn from its own seeded generator, so any worker can
produce any example and a resumed run continues with exactly the examples it had not seen. Several questions per
memory share one encoder pass, so a step trains on more questions for the same encoding.

Training for size and for similar facts, each off by default, so the default task is the one above:
- `memory_scale_max`: each training micro-batch's memories hold 1x..Nx the base number of chunks, one size per
  micro-batch (drawn from the seed and the micro-batch's number, so a resumed run sees the same sizes; each
  doubling of the size is as likely as the next). `single` adds filler chunks, `multi_key` adds facts too.
- `hard_distractors`: a share of the memory's free fact slots (those filler would fill) holds facts near-identical
  to the asked ones: the value differs in one digit and, with `key_tokens` 2, the key in one of its two tokens
  (never the whole key: a key still names one fact).
- `variants`: the training mixture over the evaluation's RULER-style tasks (pipelines.evaluate.needle asks the same
  formats): `multi_key` (more facts), `multi_value` (the asked key holds two values: `BOS k` -> both, in memory
  order or sorted, `value_order`; in training, `one_value_share` of the asked keys hold one value, so the answer's
  end is read from the memory, not from the task), `multi_query` (`BOS ka kb` -> both values),
  `variable_tracking` (`ka = kb ; kb = d d d ;`, `BOS ka` -> the digits). A memory's variant is drawn from the seed
  and its index; `generate_memory` builds them, for training and for the evaluation's probes alike.
- Tasks where retrieval by the question's words cannot find the evidence (issue 45): `alias` and `alias_multi_key`
  (single and multi_key asked by the key's alias, ALIAS_OF: the fact writes the key, so the question shares no
  token with its evidence; the answer names the key before its value, `BOS alias` -> `key d d d`, so the alias is
  translated by what training taught and the fact is read by its key, among alias_multi_key's many) and `two_hop`
  (variable tracking with each link in a chunk of its own; its memory grows as multi_key's does, with chains nobody
  asks, so the second link is one link among many). `three_hop` is scored only (TRAINED_VARIANTS leaves it out):
  whether a read learned on two hops follows a third. A chain's answer names each key it passes before the value
  (`BOS ka` -> `kb d d d`): the decoder reads again at the key it named, so every read is one lookup, as the seed's
  `<read>` has the decoder say what it reads; in one forward, a second GCA layer routed by the first one's read did
  not learn in 7,000 steps (variable tracking, docs/results/2026-11-26-variable-tracking.md). variable_tracking
  keeps RULER's answer, the value alone. Alias keys come from the len(ALIASES) key tokens that have an alias, so
  alias_multi_key holds at most that many one-token keys.
- `questions_per_row`: an in_context row asks at most this many of its memory's questions after the memory; a row
  asking every fact lets its last answer follow by elimination. The evaluation asks one question a row.
- `base_steps`: the first N training steps ask the base task alone (single, 1x, no hard distractors: the examples
  the default draws), and the mixture, sizes and hard distractors start at step N, or earlier where training saw
  the lookup form (`at_step`'s `mixture_from`: the training config's needle.base_until). Trained on all of it from
  step 0, a tiny random pair stayed on the chance plateau for 6,000 steps (docs/evaluation.md): a bigger memory and
  a mixed answer format dilute the one lookup signal that ends the plateau, which the base task forms in 1,000
  to past 3,000 steps, depending on the run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, get_args

import numpy as np
import torch

from pipelines.data.memory_modes import GCA, MemoryMode, chunks_read_each, prompt_memories_many
from pipelines.format.rows import IGNORE

PAD, BOS, EQ, SEP, EOS = 0, 1, 2, 3, 4
VALUES = range(10, 100)  # value tokens: a value position draws from the first `value_range` of them
DIGITS = VALUES[:10]
KEYS = range(100, 300)
FILLER = range(300, 496)  # every id stays below the tiny encoder's 496 and decoder's 512 vocabularies
PROMPT_LEN = 2  # BOS key, for one-token keys (NeedleSpec.prompt_len in general)
TrainedVariant = Literal["single", "multi_key", "multi_value", "multi_query", "variable_tracking", "alias",
                         "alias_multi_key", "two_hop"]
ScoredOnlyVariant = Literal["three_hop"]  # never trained: does a read learned on two hops follow a third?
Variant = Literal[TrainedVariant, ScoredOnlyVariant]
TRAINED_VARIANTS: tuple[str, ...] = get_args(TrainedVariant)  # the training mixture's choices
VARIANTS: tuple[str, ...] = get_args(Variant)  # the evaluation's; a task's place seeds its probes: append only
ALIAS_VARIANTS = ("alias", "alias_multi_key")  # asked by ALIAS_OF, else single and multi_key
GROWING_VARIANTS = ("multi_key", "alias_multi_key")  # their facts grow with the memory; at 1x, single and alias
CHAIN_HOPS = {"two_hop": 2, "three_hop": 3}  # chains with every link in a chunk of its own
# Aliases are the top of the filler range: an alias memory's keys come from ALIASED_KEYS and its filler from
# ALIAS_FILLER, so no token of the question is anywhere in its memory; elsewhere the alias ids are plain filler.
ALIASES = FILLER[-128:]
ALIASED_KEYS = KEYS[: len(ALIASES)]
ALIAS_FILLER = FILLER[: -len(ALIASES)]
ALIAS_SEED = 45  # the one fixed permutation every alias memory obeys, whatever the run's seed: training can teach it
ALIAS_OF = dict(zip(ALIASED_KEYS, np.random.default_rng(ALIAS_SEED).permutation(np.array(ALIASES)).tolist()))
KEY_TOKENS = (1, 2)
VALUE_ORDERS = ("memory", "sorted")  # multi_value's trained answer order (NeedleSpec.value_order)
SCALE_STREAM, VARIANT_STREAM = 3, 4  # generator streams beside an example's own (seed, index)


def parse_mixture(entries: tuple[str, ...] | list[str]) -> tuple[dict[str, float], list[str]]:
    """`NAME` or `NAME:WEIGHT` entries as {variant: weight} (a bare name weighs 1), and the problems found."""
    mixture: dict[str, float] = {}
    problems = []
    for entry in entries:
        name, _, weight = str(entry).partition(":")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            value = -1.0
        if name in VARIANTS and name not in TRAINED_VARIANTS:
            problems.append(f"needle.variants: {name!r} is scored only, never trained (it tests whether what was "
                            f"learned carries over); train on {TRAINED_VARIANTS}")
        elif name not in VARIANTS:
            problems.append(f"needle.variants: {name!r} is not one of {TRAINED_VARIANTS}")
        elif value <= 0 or name in mixture:
            problems.append(f"needle.variants: {entry!r} needs a positive weight and one entry per variant "
                            f"(e.g. single:4 multi_key:2)")
        else:
            mixture[name] = value
    if not entries:
        problems.append("needle.variants is empty: name at least one, e.g. single")
    return mixture, problems


@dataclass(frozen=True)
class NeedleSpec:
    facts: int = 8  # key -> value facts per memory
    questions: int = 8  # questions asked per memory (<= facts)
    value_digits: int = 3  # tokens per value
    value_range: int = 10  # distinct tokens per value position (10: decimal digits; at most 90)
    chunk_len: int = 24  # tokens per chunk; facts are packed, the rest of a fact chunk is filler
    distractors: int = 2  # chunks of filler only
    key_tokens: int = 1  # tokens per key
    hard_distractors: float = 0.0  # share of free fact slots holding facts near-identical to the asked ones
    memory_scale_max: int = 1  # training memories hold 1x..this many times the base chunks, one size per batch
    variants: tuple[str, ...] = ("single",)  # training mixture, NAME or NAME:WEIGHT
    hops: tuple[int, ...] = (2, 3)  # variable_tracking chain lengths (training draws one per memory)
    questions_per_row: int = 4  # in_context training rows: questions after one copy of the memory
    base_steps: int = 0  # training steps that ask the base task alone before the mixture, sizes and hard distractors
    value_order: str = "memory"  # multi_value's trained answer: its two values in memory order, or "sorted"
    one_value_share: float = 0.0  # share of a multi_value training memory's asked keys given no second value

    def base(self) -> "NeedleSpec":
        """The base task: single questions, base-size memories, no hard distractors (the default's examples)."""
        return replace(self, hard_distractors=0.0, memory_scale_max=1, variants=("single",), base_steps=0)

    def scored(self) -> "NeedleSpec":
        """The tasks as the evaluation asks them: every asked multi_value key holds two values."""
        return replace(self, one_value_share=0.0)

    def at_step(self, step: int, mixture_from: int | None = None) -> "NeedleSpec":
        """The task training step `step` asks: the base task until the mixture starts, then this one. It starts at
        `base_steps`, or at `mixture_from` where that is earlier (the step training saw the base task's lookup
        formed: needle.base_until)."""
        start = self.base_steps if mixture_from is None else min(mixture_from, self.base_steps)
        return self.base() if step < start else self

    @property
    def facts_per_chunk(self) -> int:
        return self.chunk_len // self.fact_len

    @property
    def fact_chunks(self) -> int:
        return -(-self.facts // max(self.facts_per_chunk, 1))

    @property
    def chunks(self) -> int:
        return self.fact_chunks + self.distractors

    @property
    def fact_len(self) -> int:
        return self.key_tokens + self.value_digits + 2  # key, '=', digits, ';'

    @property
    def prompt_len(self) -> int:
        return 1 + self.key_tokens  # BOS key

    @property
    def key_space(self) -> int:
        return len(KEYS) ** self.key_tokens

    def key_vocabulary(self, variant: str) -> range:
        """The tokens the variant's keys are made of: an alias memory's keys are those with an alias."""
        return ALIASED_KEYS if variant in ALIAS_VARIANTS else KEYS

    def mixture(self) -> dict[str, float]:
        return parse_mixture(self.variants)[0]

    def row_len(self, variant: str = "single") -> int:
        """Tokens of one question row: BOS, the key(s), the answer's tokens (the keys it names: a chain's path, an
        alias's key; the value(s)), EOS."""
        two = variant in ("multi_query", "multi_value")
        path = self.key_tokens * (CHAIN_HOPS.get(variant, 1) - 1 + (variant in ALIAS_VARIANTS))
        return self.prompt_len + self.key_tokens * (variant == "multi_query") + path + self.value_digits * (1 + two) + 1

    @property
    def longest_row(self) -> int:
        return max([self.row_len(v) for v in self.mixture()] or [self.row_len()])

    def problems(self) -> list[str]:
        problems = []
        if not 1 <= self.questions <= self.facts:
            problems.append(f"needle.questions ({self.questions}) must be between 1 and needle.facts ({self.facts})")
        if self.key_tokens not in KEY_TOKENS:
            problems.append(f"needle.key_tokens must be 1 or 2 (2: keys that share a token), got {self.key_tokens}")
        elif self.facts > self.key_space:
            problems.append(f"needle.facts ({self.facts}) exceeds the {self.key_space} distinct keys")
        if self.facts_per_chunk < 1:
            problems.append(f"needle.chunk_len ({self.chunk_len}) is shorter than one fact ({self.fact_len} tokens)")
        if not 2 <= self.value_range <= len(VALUES):
            problems.append(f"needle.value_range ({self.value_range}) must be between 2 and {len(VALUES)}")
        if self.distractors < 0:
            problems.append("needle.distractors must be >= 0")
        if self.value_order not in VALUE_ORDERS:
            problems.append(f"needle.value_order must be one of {VALUE_ORDERS}, got {self.value_order!r}")
        if not 0.0 <= self.one_value_share < 1.0:
            problems.append(f"needle.one_value_share ({self.one_value_share}) is the share of a multi_value "
                            f"memory's asked keys holding one value: give one within [0, 1)")
        if not 0.0 <= self.hard_distractors <= 1.0:
            problems.append(f"needle.hard_distractors ({self.hard_distractors}) is a share of the free fact slots: "
                            f"give one within [0, 1]")
        if self.memory_scale_max < 1:
            problems.append(f"needle.memory_scale_max ({self.memory_scale_max}) must be >= 1 (1: every memory at "
                            f"the base size)")
        mixture, bad = parse_mixture(self.variants)
        problems += bad
        if any(h < 2 for h in self.hops) or not self.hops:
            problems.append(f"needle.hops {list(self.hops)}: give chain lengths >= 2 (a chain of one is single)")
        elif {"variable_tracking", *CHAIN_HOPS} & set(mixture) and self.facts_per_chunk >= 1:
            if "variable_tracking" in mixture and self.chunks * self.facts_per_chunk < max(self.hops):
                problems.append(f"needle.hops: a {max(self.hops)}-hop chain does not fit the memory's "
                                f"{self.chunks * self.facts_per_chunk} fact slots: add needle.distractors")
            if self.key_tokens > self.value_digits:
                problems.append(f"needle.key_tokens ({self.key_tokens}) > needle.value_digits ({self.value_digits}): "
                                f"a variable_tracking link `ka = kb ;` would not fit a fact slot")
        if self.questions_per_row < 1:
            problems.append(f"needle.questions_per_row must be >= 1, got {self.questions_per_row}")
        if self.base_steps < 0:
            problems.append(f"needle.base_steps must be >= 0 (0: the whole mixture from the first step), "
                            f"got {self.base_steps}")
        if not problems:  # every task of the mixture must ask something in a base-size memory
            for variant in mixture:
                for hops in self.hops if variant == "variable_tracking" else (2,):
                    try:
                        asks = generate_memory(variant, self, 1, np.random.default_rng(0), hops).questions
                    except ValueError:
                        asks = []
                    if not asks:
                        problems.append(f"needle.variants: {variant}{f' ({hops} hops)' if hops > 2 else ''} asks "
                                        f"nothing in a memory of {self.chunks * self.facts_per_chunk} fact slots: "
                                        f"add needle.distractors or needle.facts")
        return problems


def memory_scale(spec: NeedleSpec, seed: int, batch: int) -> int:
    """The size of training micro-batch `batch`'s memories (micro-batches numbered over the whole run), in base
    memory sizes: 1 ..memory_scale_max, size k with probability ln((k+1)/k) / ln(max+1), so each doubling of the
    size is as likely as the one before (as many batches at 1x-2x as at 2x-4x). Always 1 at memory_scale_max 1."""
    if spec.memory_scale_max <= 1:
        return 1
    u = np.random.default_rng([seed, batch, SCALE_STREAM]).random()
    return min(int((spec.memory_scale_max + 1) ** u), spec.memory_scale_max)


def draw_variant(spec: NeedleSpec, seed: int, index: int) -> tuple[str, int]:
    """Memory `index`'s task from the training mixture and, for variable_tracking, its chain length."""
    mixture = spec.mixture()
    if list(mixture) == ["single"]:
        return "single", 2  # no draw: the default task's examples are exactly what they were before mixtures
    rng = np.random.default_rng([seed, index, VARIANT_STREAM])
    names = list(mixture)
    weights = np.array([mixture[n] for n in names])
    variant = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    return variant, int(rng.choice(np.array(spec.hops)))


@dataclass
class NeedleMemory:
    """One memory (chunks, chunk_len) and its questions, each with the token strings its answer must contain, the
    answer a model is trained to give (the path, then the references one after another; multi_value's two in the
    spec's value_order), where (as a fraction of the memory) the fact holding the answer starts, the chunks its
    evidence lies in (every fact the answer needs: both values, both keys, every hop), and its path: the keys its
    answer names before the value (a chain's links, two_hop and three_hop; the aliased key, alias and
    alias_multi_key; empty elsewhere); and its task."""

    memory: np.ndarray
    questions: list[list[int]]
    references: list[list[list[int]]]
    depth: list[float]
    evidence: list[list[int]]
    answers: list[list[int]]
    paths: list[list[int]]
    variant: str = "single"


def draw_keys(rng: np.random.Generator, spec: NeedleSpec, n: int, vocabulary: range = KEYS) -> list[list[int]]:
    """n distinct keys of spec.key_tokens tokens each, made of the vocabulary's tokens."""
    if spec.key_tokens == 1:
        return [[k] for k in rng.choice(np.array(vocabulary), size=n, replace=False).tolist()]
    picks = rng.choice(len(vocabulary) ** 2, size=n, replace=False).tolist()
    return [[vocabulary[p // len(vocabulary)], vocabulary[p % len(vocabulary)]] for p in picks]


def alias(key: list[int]) -> list[int]:
    """The key as an alias question names it, token by token (ALIAS_OF)."""
    return [ALIAS_OF[t] for t in key]


def near_facts(rng: np.random.Generator, spec: NeedleSpec, targets: list[tuple[list[int], list[int]]],
               taken: set[tuple[int, ...]], count: int, vocabulary: range = KEYS) -> list[list[int]]:
    """Up to `count` facts near-identical to the targets (key, value), round robin: the value differs in one digit,
    the key in one token of the vocabulary (one-token keys: another key; there is no nearer one). A new key is never
    one in `taken` (every key of the memory, so no asked key gets a second fact), and joins it."""
    facts = []
    for n in range(count):
        key, value = targets[n % len(targets)]
        position = int(rng.integers(len(key)))
        swap = lambda t: tuple(key[:position] + [t] + key[position + 1 :])  # noqa: E731
        for token in rng.integers(vocabulary.start, vocabulary.stop, size=8).tolist():  # most keys are free
            if swap(token) not in taken:
                break
        else:  # a crowded memory: choose among the free ones
            free = [t for t in vocabulary if swap(t) not in taken]
            if not free:
                continue
            token = free[int(rng.integers(len(free)))]
        taken.add(swap(token))
        digits = list(value)
        d = int(rng.integers(len(digits)))
        digits[d] = VALUES[(digits[d] - VALUES.start + int(rng.integers(1, spec.value_range))) % spec.value_range]
        facts.append([*swap(token), EQ, *digits, SEP])
    return facts


class DrawnFacts(NamedTuple):
    """A memory's facts before placement and, per question: its prompt, its references, the fact holding its
    (first) answer, every fact it needs; the (key, value) facts hard distractors imitate; per question the keys
    its answer names before the value (chains, aliases; None: none); and the groups of facts each placed in chunks
    of their own (every chain of the memory, asked or not; None: the asked questions' `needed`)."""

    facts: list[list[int]]
    asked: list[list[int]]
    refs: list[list[list[int]]]
    answer_fact: list[int]
    needed: list[list[int]]
    targets: list[tuple[list[int], list[int]]]
    paths: list[list[int]] | None = None
    apart: list[list[int]] | None = None


def chain_facts(spec: NeedleSpec, slots: int, hops: int, rng: np.random.Generator, digits,
                named: bool = False, scale: int = 1) -> DrawnFacts:
    """Chains `ka = kb ; kb = d d d ;` of `hops` facts, asked `BOS ka`: up to spec.questions, as many as fit.
    `named`: each answer names the keys it passes (`kb d d d`), else the value alone. `scale`: the memory holds
    chains of spec.facts x scale facts in all (as multi_key's facts grow), the unasked ones a haystack of links: a
    retriever that reads the question alone finds the first link by its key, but cannot tell the second from any
    other chain's; at 1x it holds the asked chains alone. Every key is distinct: as many chains as the keys allow."""
    chains_held = min(slots, spec.key_space, max(spec.questions * hops, spec.facts * scale)) // hops
    questions = min(spec.questions, chains_held)
    keys = draw_keys(rng, spec, chains_held * hops)
    chains = [keys[c * hops : (c + 1) * hops] for c in range(chains_held)]
    values = digits(chains_held)
    facts = [[*a, EQ, *b, SEP] for chain in chains for a, b in zip(chain, chain[1:])]
    facts += [[*chain[-1], EQ, *v, SEP] for chain, v in zip(chains, values, strict=True)]
    links = hops - 1
    apart = [[c * links + h for h in range(links)] + [chains_held * links + c] for c in range(chains_held)]
    asked = chains[:questions]
    return DrawnFacts(facts, [[BOS, *chain[0]] for chain in asked], [[v] for v in values[:questions]],
                      [group[-1] for group in apart[:questions]], apart[:questions],
                      [(chain[-1], v) for chain, v in zip(asked, values[:questions], strict=True)],
                      [[t for key in chain[1:] for t in key] for chain in asked] if named else None, apart)


def keyed_facts(variant: str, spec: NeedleSpec, scale: int, slots: int, rng: np.random.Generator,
                digits) -> DrawnFacts:
    """`key = d d d ;` facts, asked by their key (alias variants: by its alias) one or two a question."""
    vocabulary = spec.key_vocabulary(variant)
    room = slots // 2 if variant == "multi_value" else slots  # multi_value: a second fact for each
    grows = variant in GROWING_VARIANTS
    n_facts = min(spec.facts * (scale if grows else 1), len(vocabulary) ** spec.key_tokens, room)
    keys = draw_keys(rng, spec, n_facts, vocabulary)
    values = digits(n_facts)
    facts = [[*k, EQ, *v, SEP] for k, v in zip(keys, values, strict=True)]
    if variant == "multi_query":  # two facts a question: an even number of them
        order = rng.choice(n_facts, size=min(2 * spec.questions, n_facts - n_facts % 2), replace=False)
        pairs = order.reshape(-1, 2).tolist()
        return DrawnFacts(facts, [[BOS, *keys[a], *keys[b]] for a, b in pairs],
                          [[values[a], values[b]] for a, b in pairs], [a for a, _ in pairs],
                          [list(pair) for pair in pairs], [(keys[f], values[f]) for pair in pairs for f in pair])
    order = rng.choice(n_facts, size=min(spec.questions, n_facts), replace=False).tolist()
    named = alias if variant in ALIAS_VARIANTS else list
    # an alias answer names the key it translates the alias to (`BOS alias` -> `key d d d`), as a chain's names its
    # next key: the token prior then reads that key's chunk among the memory's many facts
    drawn = DrawnFacts(facts, [[BOS, *named(keys[f])] for f in order], [[values[f]] for f in order], order,
                       [[f] for f in order], [(keys[f], values[f]) for f in order],
                       [list(keys[f]) for f in order] if variant in ALIAS_VARIANTS else None)
    if variant == "multi_value":  # a second value for the asked keys, somewhere else in the memory
        # in training, spec.one_value_share of them keep one: the answer's end is then told by the key's facts
        # in the memory, not by the task
        twice = order[: len(order) - round(spec.one_value_share * len(order))]
        second = digits(len(twice))
        drawn.needed[: len(twice)] = [[f, len(facts) + q] for q, f in enumerate(twice)]
        facts += [[*keys[f], EQ, *v, SEP] for f, v in zip(twice, second, strict=True)]
        drawn.refs[: len(twice)] = [[values[f], s] for f, s in zip(twice, second, strict=True)]
    return drawn


def generate_memory(variant: str, spec: NeedleSpec, scale: int, rng: np.random.Generator, hops: int = 2,
                    hard: float = 0.0) -> NeedleMemory:
    """A memory of `scale` times the base size (spec.chunks chunks) holding the variant's facts, and its questions:
    the evaluation's probes (pipelines.evaluate.needle) and the training mixture's memories. `hops`: variable
    tracking's chain length (two_hop and three_hop name their own). `hard`: the share of the free fact slots given
    to near-identical facts (near_facts) of the facts holding answers."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown needle variant {variant!r}; choose from {VARIANTS}")
    chunks = spec.chunks * scale
    slots = chunks * spec.facts_per_chunk

    def digits(n: int) -> list[list[int]]:
        return [rng.choice(np.array(VALUES[: spec.value_range]), size=spec.value_digits).tolist() for _ in range(n)]

    if variant == "variable_tracking" or variant in CHAIN_HOPS:
        drawn = chain_facts(spec, slots, CHAIN_HOPS.get(variant, hops), rng, digits, named=variant in CHAIN_HOPS,
                            scale=scale if variant in CHAIN_HOPS else 1)
    else:
        drawn = keyed_facts(variant, spec, scale, slots, rng, digits)
    facts, refs, needed = drawn.facts, drawn.refs, drawn.needed
    if hard > 0:
        taken = {tuple(fact[: fact.index(EQ)]) for fact in facts}
        facts += near_facts(rng, spec, drawn.targets, taken, int(hard * (slots - len(facts))),
                            spec.key_vocabulary(variant))
    if variant in CHAIN_HOPS:
        memory, starts = place_apart(facts, drawn.apart or needed, spec, chunks, rng)
    else:
        memory, starts = place(facts, spec, chunks, rng, ALIAS_FILLER if variant in ALIAS_VARIANTS else FILLER)
    paths = drawn.paths or [[] for _ in drawn.asked]
    answers = [path + [t for ref in (trained_order(refs_q, [starts[f] for f in facts_needed], spec.value_order)
                                     if variant == "multi_value" else refs_q) for t in ref]
               for path, refs_q, facts_needed in zip(paths, refs, needed, strict=True)]
    return NeedleMemory(memory=memory, questions=drawn.asked, references=refs,
                        depth=[starts[f] / (chunks * spec.chunk_len) for f in drawn.answer_fact],
                        evidence=[sorted({starts[f] // spec.chunk_len for f in facts_needed})
                                  for facts_needed in needed],
                        answers=answers, paths=paths, variant=variant)


def trained_order(values: list[list[int]], starts: list[int], order: str) -> list[list[int]]:
    """multi_value's values in the order its trained answer gives them: where their facts start in the memory
    ("memory"), or by their digits ("sorted"). A reader that sees each chunk apart from the others, as gca's blocks
    do, cannot tell which of two chunks comes first, so memory order is a coin flip to it; the digits are not."""
    if order == "sorted":
        return sorted(values)
    return [ref for _, ref in sorted(zip(starts, values))]


def place(facts: list[list[int]], spec: NeedleSpec, chunks: int, rng: np.random.Generator,
          filler: range = FILLER) -> tuple[np.ndarray, list[int]]:
    """As make_example builds a memory: the facts shuffled and packed slot after slot into randomly chosen chunks
    among `chunks`, filler everywhere else; each fact's start position."""
    fact_chunks = -(-len(facts) // spec.facts_per_chunk)
    if fact_chunks > chunks:
        raise ValueError(f"{len(facts)} facts do not fit in {chunks} chunks of {spec.facts_per_chunk} slots")
    memory = rng.choice(np.array(filler), size=(chunks, spec.chunk_len))
    chunk_of_slot = np.sort(rng.choice(chunks, size=fact_chunks, replace=False))
    starts = [0] * len(facts)
    for n, fact in enumerate(rng.permutation(len(facts)).tolist()):
        chunk = int(chunk_of_slot[n // spec.facts_per_chunk])
        offset = (n % spec.facts_per_chunk) * spec.fact_len
        memory[chunk, offset : offset + len(facts[fact])] = facts[fact]
        starts[fact] = chunk * spec.chunk_len + offset
    return memory, starts


def place_apart(facts: list[list[int]], chains: list[list[int]], spec: NeedleSpec, chunks: int,
                rng: np.random.Generator) -> tuple[np.ndarray, list[int]]:
    """As place, but each chain's facts (indices into `facts`) in chunks of their own, so no chunk alone answers a
    chain's question. Chains go first, each to the fact chunks with the most free slots (ties at random), which
    keeps the chunks level so every chain finds room; the other facts then take the free slots at random."""
    per_chunk = spec.facts_per_chunk
    fact_chunks = max(-(-len(facts) // per_chunk), *(len(chain) for chain in chains))
    if fact_chunks > chunks:
        raise ValueError(f"{len(facts)} facts in chains of up to {fact_chunks} do not fit in {chunks} chunks of "
                         f"{per_chunk} slots, one chunk per link")
    memory = rng.choice(np.array(FILLER), size=(chunks, spec.chunk_len))
    where = rng.choice(chunks, size=fact_chunks, replace=False)  # the fact chunks, in no particular order
    free = [rng.permutation(per_chunk).tolist() for _ in range(fact_chunks)]  # each one's free slots, drawn in turn
    slot_of: dict[int, tuple[int, int]] = {}
    for c in rng.permutation(len(chains)).tolist():
        tie = rng.random(fact_chunks)
        roomiest = sorted(range(fact_chunks), key=lambda n: (-len(free[n]), tie[n]))[: len(chains[c])]
        for fact, n in zip(chains[c], rng.permutation(roomiest).tolist(), strict=True):
            slot_of[fact] = (n, free[n].pop())
    rest = [(n, slot) for n in range(fact_chunks) for slot in free[n]]
    others = [f for f in range(len(facts)) if f not in slot_of]
    for fact, pick in zip(others, rng.permutation(len(rest))[: len(others)].tolist(), strict=True):
        slot_of[fact] = rest[pick]
    starts = [0] * len(facts)
    for fact, (n, slot) in slot_of.items():
        offset = slot * spec.fact_len
        memory[where[n], offset : offset + len(facts[fact])] = facts[fact]
        starts[fact] = int(where[n]) * spec.chunk_len + offset
    return memory, starts


def make_example(spec: NeedleSpec, seed: int, index: int, scale: int = 1,
                 variant: str | None = None) -> dict[str, np.ndarray]:
    """One memory with its questions: memory (chunks, chunk_len), input_ids/labels (questions, prompt + answer +
    EOS), depth (questions,) = where each asked fact starts, as a fraction of the memory, prompt_len. Its task is
    `variant`, else drawn from the spec's mixture; `scale` times the base memory size. The default task (single,
    no hard distractors, one-token keys) draws exactly as before mixtures existed."""
    hops = 2
    if variant is None:
        variant, hops = draw_variant(spec, seed, index)
    elif variant == "variable_tracking":
        hops = int(np.random.default_rng([seed, index, VARIANT_STREAM]).choice(np.array(spec.hops)))
    if variant == "single" and spec.hard_distractors == 0 and spec.key_tokens == 1:
        return single_example(spec, seed, index, scale)
    drawn = generate_memory(variant, spec, scale, np.random.default_rng([seed, index]), hops, spec.hard_distractors)
    width = max(len(question) + len(answer) for question, answer in zip(drawn.questions, drawn.answers)) + 1
    # rows of one memory are as long as its longest (one_value_share's answers differ): PAD, no label, after EOS
    rows = [question + answer + [EOS] + [PAD] * (width - len(question) - len(answer) - 1)
            for question, answer in zip(drawn.questions, drawn.answers, strict=True)]
    labels = [[IGNORE] * len(question) + answer + [EOS] + [IGNORE] * (width - len(question) - len(answer) - 1)
              for question, answer in zip(drawn.questions, drawn.answers, strict=True)]
    return {"memory": drawn.memory, "input_ids": np.array(rows), "labels": np.array(labels),
            "depth": np.array(drawn.depth), "prompt_len": len(drawn.questions[0])}


def single_example(spec: NeedleSpec, seed: int, index: int, scale: int = 1) -> dict[str, np.ndarray]:
    """The default task: `facts` one-token-key facts in scale x spec.chunks chunks, `questions` of them asked."""
    rng = np.random.default_rng([seed, index])
    chunks = spec.chunks * scale
    keys = rng.choice(np.array(KEYS), size=spec.facts, replace=False)
    values = rng.choice(np.array(VALUES[: spec.value_range]), size=(spec.facts, spec.value_digits))
    memory = rng.choice(np.array(FILLER), size=(chunks, spec.chunk_len))
    order = rng.permutation(spec.facts)  # facts shuffled, then packed chunk after chunk
    fact_chunk_slots = np.sort(rng.choice(chunks, size=spec.fact_chunks, replace=False))
    starts = np.zeros(spec.facts, dtype=np.int64)
    for n, fact in enumerate(order):
        chunk = fact_chunk_slots[n // spec.facts_per_chunk]
        offset = (n % spec.facts_per_chunk) * spec.fact_len
        memory[chunk, offset : offset + spec.fact_len] = [keys[fact], EQ, *values[fact], SEP]
        starts[fact] = chunk * spec.chunk_len + offset
    asked = rng.choice(spec.facts, size=spec.questions, replace=False)
    prompts = np.stack([np.array([BOS, keys[f]]) for f in asked])
    targets = np.concatenate([values[asked], np.full((spec.questions, 1), EOS)], axis=1)
    input_ids = np.concatenate([prompts, targets], axis=1)
    labels = input_ids.copy()
    labels[:, : prompts.shape[1]] = IGNORE  # loss on the answer only
    return {
        "memory": memory,
        "input_ids": input_ids,
        "labels": labels,
        "depth": starts[asked] / (chunks * spec.chunk_len),
        "prompt_len": PROMPT_LEN,
    }


def answer_lengths(example: dict[str, np.ndarray]) -> list[int]:
    """Per question row of make_example's: its answer's tokens and EOS, the labelled ones (a shorter row's padding
    after EOS has no label)."""
    return (example["labels"] != IGNORE).sum(1).tolist()


def answer_positions(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """(Q, longest answer): each question's answer positions, its EOS last (an answer that does not end there is
    not whole), a shorter answer's last one repeated (exact match over the row is unchanged by a repeat)."""
    width = max(lengths)
    return torch.tensor([[s + min(d, n - 1) for d in range(width)] for s, n in zip(starts, lengths, strict=True)])


def make_batch(spec: NeedleSpec, seed: int, indices: list[int], scale: int = 1,
               variant: str | None = None) -> dict[str, torch.Tensor]:
    """Memories (B, chunks, chunk_len) and questions (B * R, T), question rows grouped by memory, which is how the
    GCA blocks fold them onto one encoder pass; every memory gets R rows (the most any of them asks; a task asking
    fewer, multi_query or variable_tracking, is padded with rows of PAD and no label) and every row T tokens (right
    padding, no label: causal attention never reads it). `answer_rows` and `answer_positions` say where each
    question's answer tokens stand (needle_batch)."""
    examples = [make_example(spec, seed, i, scale, variant) for i in indices]
    per_memory = max(len(e["input_ids"]) for e in examples)
    width = max(e["input_ids"].shape[1] for e in examples)
    input_ids = torch.full((len(examples) * per_memory, width), PAD, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE)
    rows, starts, lengths = [], [], []
    for b, e in enumerate(examples):
        q, t = e["input_ids"].shape
        input_ids[b * per_memory : b * per_memory + q, :t] = torch.from_numpy(e["input_ids"])
        labels[b * per_memory : b * per_memory + q, :t] = torch.from_numpy(e["labels"])
        rows += range(b * per_memory, b * per_memory + q)
        starts += [e["prompt_len"]] * q
        lengths += answer_lengths(e)
    return {
        "memory_input_ids": torch.from_numpy(np.stack([e["memory"] for e in examples])),
        "input_ids": input_ids,
        "labels": labels,
        "depth": torch.from_numpy(np.concatenate([e["depth"] for e in examples])),
        "answer_rows": torch.tensor(rows),
        "answer_positions": answer_positions(starts, lengths),
    }


def answer_span(spec: NeedleSpec) -> slice:
    """Positions of the logits that predict the value digits (the prompt is BOS key)."""
    return slice(spec.prompt_len - 1, spec.prompt_len - 1 + spec.value_digits)


def named_keys(answer: list[int], key_tokens: int) -> list[list[int]]:
    """The keys an answer names (a chain's path), each asked as a question asks it: `BOS key`."""
    keys = [t for t in answer if t in KEYS]
    return [[BOS, *keys[at : at + key_tokens]] for at in range(0, len(keys) - key_tokens + 1, key_tokens)]


def needle_batch(spec: NeedleSpec, seed: int, indices: list[int], mode: MemoryMode = GCA, scale: int = 1,
                 variant: str | None = None, questions_per_row: int | None = None) -> dict[str, torch.Tensor]:
    """The batch a system with memory `mode` trains and is scored on, plus where each question's answer tokens stand:
    `answer_rows` (Q,) and `answer_positions` (Q, answer tokens and EOS), Q = the memories' questions, in make_batch's
    order.

    gca: make_batch (memories read through the encoder). in_context: the memory's tokens, then up to
    `questions_per_row` (default: the spec's) of its questions one after another (they share the prefix, as GCA's
    questions share one encoder pass; a question sees the ones before it, never its own answer); further questions
    start another row with the memory again. rag: one row per question, its top-k chunks then the question (an
    iterative rag's, mode.reread: with the top-k of each key its answer names, as it holds them having named each).
    none: the questions alone."""
    if mode.kind == "gca":
        return make_batch(spec, seed, indices, scale, variant)
    per_row = questions_per_row or spec.questions_per_row
    rows: list[list[int]] = []
    labels: list[list[int]] = []
    answer_rows, answer_starts, lengths, depth = [], [], [], []
    examples = [make_example(spec, seed, index, scale, variant) for index in indices]
    chunks_each = [example["memory"].tolist() for example in examples]
    questions_each = [example["input_ids"].tolist() for example in examples]
    # a retriever indexes (or embeds) a memory once for all its questions; in_context's rows need no query
    queries_each = [[[] if mode.kind == "in_context" else q[: example["prompt_len"]] for q in questions]
                    for example, questions in zip(examples, questions_each, strict=True)]
    if mode.reread:  # an iterative rag holds what it retrieves again at each key its answer names
        memories_each = []
        for example, chunks, queries, questions in zip(examples, chunks_each, queries_each, questions_each,
                                                       strict=True):
            rereads = [named_keys(q[example["prompt_len"]:], spec.key_tokens) for q in questions]
            memories_each.append([[t for i in kept for t in chunks[i]]
                                  for kept in chunks_read_each(chunks, queries, rereads, mode)])
    else:
        memories_each = prompt_memories_many(chunks_each, queries_each, mode)
    for example, questions, memories in zip(examples, questions_each, memories_each, strict=True):
        prompt_len = example["prompt_len"]
        depth.append(example["depth"])
        for n, (question, target, length) in enumerate(zip(questions, example["labels"].tolist(),
                                                           answer_lengths(example), strict=True)):
            question, target = question[: prompt_len + length], target[: prompt_len + length]  # no padding
            if mode.kind != "in_context" or n % per_row == 0:
                rows.append(memories[n])
                labels.append([IGNORE] * len(rows[-1]))
            answer_rows.append(len(rows) - 1)
            answer_starts.append(len(rows[-1]) + prompt_len)
            lengths.append(len(question) - prompt_len)  # the answer's tokens and EOS
            rows[-1] = rows[-1] + question
            labels[-1] = labels[-1] + target
    width = max(len(r) for r in rows)  # rows are right-padded: causal attention never reads the padding
    input_ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    label_ids = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (ids, labs) in enumerate(zip(rows, labels, strict=True)):
        input_ids[r, : len(ids)], label_ids[r, : len(labs)] = torch.tensor(ids), torch.tensor(labs)
    return {"input_ids": input_ids, "labels": label_ids, "depth": torch.from_numpy(np.concatenate(depth)),
            "answer_rows": torch.tensor(answer_rows), "answer_positions": answer_positions(answer_starts, lengths)}


def noisy_copy_rows(spec: NeedleSpec, seed: int, count: int, noise: float) -> list[dict]:
    """Corpus rows (jobs/build_corpus.py's token columns) of one question each: the memory's chunks, the prompt
    `BOS key`, and a target whose value digits each are, with probability `noise`, replaced by a random digit. The
    label is one sample; the best prediction is the whole mixture (1 - noise + noise/10 on the memory's digit), which
    a teacher that has learned the task gives and a one-hot label does not (stage 4's default corpus)."""
    rows = []
    for index in range(count):
        example = make_example(spec, seed, index)
        rng = np.random.default_rng([seed, index, 1])
        input_ids, labels = example["input_ids"][0].copy(), example["labels"][0].copy()  # the first question
        start = example["prompt_len"]
        digits = np.arange(start, len(input_ids) - 1)  # the answer's tokens, EOS not
        replaced = digits[rng.random(len(digits)) < noise]
        input_ids[replaced] = labels[replaced] = rng.choice(np.array(VALUES[: spec.value_range]), size=len(replaced))
        rows.append({"task": "needle", "variant": "noisy_copy", "input_ids": input_ids.tolist(),
                     "labels": labels.tolist(), "memory_input_ids": example["memory"].tolist()})
    return rows
