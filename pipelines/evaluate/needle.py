"""The needle suite: RULER-style needle probes (Hsieh et al. 2024) in the needle vocabulary stage 0 trains on, asked
of each system on Ray Data actors and scored.

Probes are generated offline and deterministically per (variant, memory size, seed, index), so every system is asked
exactly the same questions. Variants: `single` (the training task at a new memory size), `multi_key` (more key ->
value needles, one asked per question: the others are distractors that look like the answer), `multi_value` (the
asked key holds two values; both must be answered), `multi_query` (one question names two keys; both values must be
answered), `variable_tracking` (2-3 hops: `ka = kb ; kb = d d d ;`, asked `ka`), and the tasks retrieval by the
question's words cannot solve: `alias` and `alias_multi_key` (asked by the key's alias, sharing no token with the
evidence), `two_hop` and `three_hop` (each link in a chunk of its own, the answer naming each key it passes before
the value, `kb d d d`; three_hop is never trained). Memory size counts chunks; facts are packed into fact-sized slots as
stage 0 packs them (a shorter fact is followed by filler), so `single` at 1x is the training distribution and the
memory's size does not depend on its contents. Scoring is RULER's string match: a question's references must appear in
the generated answer. A probe is built by the generator stage 0's training mixture uses
(synthetic_needles.generate_memory, `--needle.variants` in training), so each variant's format is the one a system
trained on it learned; `--needle.hard_distractors` fills a share of every probe's free fact slots with facts
near-identical to the asked ones. A system trained on two-token keys is asked two-token keys.

`--needle.reread NAME` makes a rag or dense_rag system an iterative rag: at each key its answer names (a chain's next
key) it retrieves the top rag_k chunks for that key and reads on with them in its prompt too, as gca reads again at the
key it names; its evidence recall counts every chunk it retrieved.

`score_probe` is what one worker does with one loaded system; it takes no Ray, so a test calls it directly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

import numpy as np
import torch

from pipelines.data.batch_inference import items_dataset, map_with_actors
from transformers import StoppingCriteria

from pipelines.data.memory_modes import (MemoryMode, chunks_in_prompt, chunks_in_prompt_each, chunks_read_each,
                                         evidence_held, prompt_memories)
from pipelines.data.needle_tokenizer import needle_tokenizer
from pipelines.data.synthetic_needles import (EOS, KEYS, PAD, VARIANTS, NeedleMemory, NeedleSpec, Variant,
                                              generate_memory, named_keys)
from pipelines.evaluate import probes
from pipelines.evaluate.common import (Progress, Source, SuiteResult, System, Workers, batch_columns, load_system,
                                       needle_spec)
from pipelines.evaluate.metrics import evidence_reading, rate_interval, string_match_all
from pipelines.format.rows import IGNORE
from pipelines.memory.store import STATES_DTYPES, read_memory_as_stored


@dataclass
class NeedleSuite:
    variants: list[Variant] = field(default_factory=lambda: list(VARIANTS))  # RULER-style tasks (VARIANTS above)
    multipliers: list[int] = field(default_factory=lambda: [1, 4, 16])  # memory sizes, in training memory sizes
    memories: int = 16  # probe memories per (variant, size); each asks needle.questions questions
    hops: list[int] = field(default_factory=lambda: [2, 3])  # variable-tracking chain lengths
    seed: int = 20261123  # probes come from their own seed, never from training's or validation's
    depth_bins: int = 4  # accuracy by where the fact sits in the memory, in this many equal bins
    # share (0-1) of each probe's free fact slots holding facts near-identical to the asked ones (stage 0's
    # needle.hard_distractors), the same for every system
    hard_distractors: float = 0.0
    # read each memory as a memory store in this dtype gives it back (float32 | bfloat16 | float16 | int8:
    # jobs/encode_memory.py --store_dtype), not as encoded; none: as encoded
    store_dtype: str | None = None
    # systems (by their --names) that retrieve again at each key their answer names: an iterative rag (rag and
    # dense_rag exports; a plain export may be scored with and without it under two names, while one trained with
    # model.rag_reread always retrieves again)
    reread: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        p = []
        bad = set(self.variants) - set(VARIANTS)
        if bad:
            p.append(f"needle.variants {sorted(bad)} unknown; choose from {VARIANTS}")
        if any(m < 1 for m in self.multipliers) or self.memories < 1:
            p.append("needle.multipliers and needle.memories must be positive")
        if any(h < 2 for h in self.hops):
            p.append("needle.hops must be >= 2 (a chain of one is the single task)")
        if self.store_dtype is not None and self.store_dtype not in STATES_DTYPES:
            p.append(f"needle.store_dtype {self.store_dtype!r}: choose one of {', '.join(STATES_DTYPES)}")
        if not 0.0 <= self.hard_distractors <= 1.0:
            p.append(f"needle.hard_distractors ({self.hard_distractors}) is a share of the free fact slots: give one "
                     f"within [0, 1]")
        return p


# ---------------------------------------------------------------------------------------------- probes
Probe = NeedleMemory  # one memory and its questions (pipelines.data.synthetic_needles builds both)


def memory_chunks(spec: NeedleSpec, multiplier: int) -> int:
    """A memory `multiplier` times the training memory's size, in chunks."""
    return spec.chunks * multiplier


def make_probe(variant: str, spec: NeedleSpec, multiplier: int, seed: int, index: int, hops: int = 2,
               hard_distractors: float = 0.0) -> Probe:
    """The probe (variant, size, seed, index), from a generator of its own: the memories stage 0 trains on for that
    variant and size (synthetic_needles.generate_memory), drawn apart from them."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown needle variant {variant!r}; choose from {VARIANTS}")
    rng = np.random.default_rng([seed, VARIANTS.index(variant), multiplier, hops, index])
    return generate_memory(variant, spec.scored(), multiplier, rng, hops=hops, hard=hard_distractors)


def as_text(tokens: list[int]) -> str:
    """Token ids as space-separated words with a space at both ends, so a reference matches whole tokens only."""
    return " " + " ".join(str(t) for t in tokens) + " "


# ---------------------------------------------------------------------------------------------- answers
def system_prompts(probe: Probe, mode: MemoryMode) -> dict[str, torch.Tensor]:
    """One row per question, as the system sees it: the question alone (gca, none), after the whole memory
    (in_context) or after its top-k chunks (rag, dense_rag); gca rows carry the memory for the encoder."""
    chunks = probe.memory.tolist()
    rows = [memory + question
            for memory, question in zip(prompt_memories(chunks, probe.questions, mode), probe.questions, strict=True)]
    inputs = {"input_ids": torch.tensor(rows)}  # a probe's rows have equal lengths (its questions do)
    if mode.kind == "gca":
        inputs["memory_input_ids"] = torch.from_numpy(probe.memory)[None].expand(len(rows), -1, -1)
    return inputs


def served_answers(system: System, probe: Probe) -> list[list[int]]:
    """The registered pyfunc's answers to the probe as text (the needle vocabulary's words: `k117`, digits, `w300`),
    read back into ids through the same tokenizer."""
    tokenizer = needle_tokenizer()
    words = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    memory = [words(chunk) for chunk in probe.memory.tolist()]
    rows = [{"question": words(question[1:]), "memory": memory} for question in probe.questions]  # BOS: the tokenizer's
    new = answer_budget(probe)
    answers = system.served.predict(rows, params={"max_new_tokens": new})
    return [tokenizer.encode(answer, add_special_tokens=False).ids for answer in answers]


def answer_budget(probe: Probe) -> int:
    """New tokens a probe's answers may take: its longest trained answer (a chain's path, then the references), plus
    EOS."""
    return max(len(answer) for answer in probe.answers) + 1


class KeyNamed(StoppingCriteria):
    """Stops a one-row generation once the tokens it generated end in a whole key (key_tokens key ids in a row)."""

    def __init__(self, prompt_len: int, key_tokens: int):
        self.prompt_len, self.key_tokens = prompt_len, key_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        run = 0
        for token in reversed(input_ids[0, self.prompt_len :].tolist()):
            if token not in KEYS:
                break
            run += 1
        return torch.tensor([run > 0 and run % self.key_tokens == 0], device=input_ids.device)


@torch.no_grad()
def reread_answers(system: System, probe: Probe) -> tuple[list[list[int]], list[list[int]]]:
    """An iterative rag's greedy answers and, per question, every chunk it retrieved: it answers from the question's
    top rag_k chunks and, each time its answer names a key, retrieves the top rag_k for that key (`BOS key`, as a
    question asks it) and reads on with them in its prompt too (memory order, within the context budget)."""
    chunks, budget, key_tokens = probe.memory.tolist(), answer_budget(probe), system.spec.key_tokens
    answers, retrieved = [], []
    for question in probe.questions:
        kept, answer = chunks_in_prompt(chunks, question, system.mode), []
        while len(answer) < budget and EOS not in answer:
            prompt = [t for i in kept for t in chunks[i]] + question + answer
            out = system.model.generate(input_ids=torch.tensor([prompt], device=system.model.device),
                                        max_new_tokens=budget - len(answer), do_sample=False, eos_token_id=EOS,
                                        pad_token_id=PAD, stopping_criteria=[KeyNamed(len(prompt), key_tokens)])
            new = out[0, len(prompt) :].tolist()
            answer += new
            if not new or not KeyNamed(len(answer) - len(new), key_tokens)(torch.tensor([answer]), None)[0]:
                break  # the answer ended (EOS, or its budget) without naming a key last
            kept = chunks_read_each(chunks, [question], [named_keys(answer, key_tokens)], system.mode)[0]
        answers.append(answer[: answer.index(EOS)] if EOS in answer else answer)
        retrieved.append(kept)
    return answers, retrieved


@torch.no_grad()
def answer_probe(system: System, probe: Probe) -> list[list[int]]:
    """Greedy answers, each cut at EOS: long enough for every reference of the question plus EOS."""
    if system.served is not None:
        return served_answers(system, probe)
    if system.mode.reread:
        return reread_answers(system, probe)[0]
    inputs = {k: v.to(system.model.device) for k, v in system_prompts(probe, system.mode).items()}
    new = answer_budget(probe)
    out = system.model.generate(**inputs, max_new_tokens=new, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    answers = []
    for row in out[:, inputs["input_ids"].shape[1] :].tolist():
        answers.append(row[: row.index(EOS)] if EOS in row else row)
    return answers


@torch.no_grad()
def answer_end_loss(system: System, probe: Probe) -> list[float]:
    """Per question, the loss (nats) of EOS right after its trained answer, teacher-forced: whether the system knows
    where an answer ends, apart from finding it (a whole answer needs both; RULER's match only the first). Answers
    of unequal lengths are right-padded, which a causal decoder's earlier positions do not see; the labels mark the
    answer, so gca's lexical prior is the question's, as when it generates."""
    inputs = {k: v.to(system.model.device) for k, v in system_prompts(probe, system.mode).items()}
    prompt = inputs.pop("input_ids")
    if "memory_input_ids" in inputs:  # a probe's rows share one memory: encoded once, every row reads it (as beams do)
        inputs["memory_input_ids"] = inputs["memory_input_ids"][:1]
    longest = max(len(answer) for answer in probe.answers) + 1
    answers = torch.tensor([answer + [EOS] + [PAD] * (longest - len(answer) - 1) for answer in probe.answers],
                           device=prompt.device)
    labels = torch.cat([torch.full_like(prompt, IGNORE), answers.masked_fill(answers == PAD, IGNORE)], 1)
    logits = system.model(input_ids=torch.cat([prompt, answers], 1), labels=labels, **inputs).logits
    ends = torch.tensor([prompt.shape[1] + len(answer) - 1 for answer in probe.answers], device=prompt.device)
    end_logits = logits[torch.arange(len(ends), device=prompt.device), ends].float()  # the logits that predict EOS
    return (-end_logits.log_softmax(-1)[:, EOS]).tolist()


@torch.no_grad()
def reread_end_loss(system: System, probe: Probe) -> list[float]:
    """answer_end_loss for an iterative rag: each question's prompt holds what its training row holds, the chunks
    retrieved for the question and for each key its trained answer names; one row at a time, since those prompts
    differ in length."""
    chunks = probe.memory.tolist()
    rereads = [named_keys(answer, system.spec.key_tokens) for answer in probe.answers]
    losses = []
    for question, answer, kept in zip(probe.questions, probe.answers,
                                      chunks_read_each(chunks, probe.questions, rereads, system.mode), strict=True):
        ids = torch.tensor([[t for i in kept for t in chunks[i]] + question + answer], device=system.model.device)
        losses.append(-system.model(input_ids=ids).logits[0, -1].float().log_softmax(-1)[EOS].item())
    return losses


def score_probe(system: System, variant: str, multiplier: int, seed: int, index: int, hops: int = 2,
                depth_bins: int = 4, hard_distractors: float = 0.0) -> list[dict[str, Any]]:
    """One row per question: RULER's string_match_all (share of its references found, whole tokens), exact (all
    found), whole (the answer is its path and references and nothing else, in some order, ended within the budget:
    RULER's match also passes an answer that gives the value twice or runs on), the depth bin of the fact holding the
    answer, the teacher-forced loss of the answer's end (answer_end_loss, reread_end_loss; NaN for a served pyfunc,
    which shows no logits), for gca where its attention went, and for rag and in_context whether the
    evidence reached the prompt."""
    probe = make_probe(variant, system.spec, multiplier, seed, index, hops=hops, hard_distractors=hard_distractors)
    retrieved = None
    if system.mode.reread and system.served is None:
        answers, retrieved = reread_answers(system, probe)
    else:
        answers = answer_probe(system, probe)
    local = system.served is None  # a pyfunc shows neither its logits nor its attention
    reading = memory_attention(system, probe) if local and system.mode.kind == "gca" else [{}] * len(answers)
    if not local:
        end_losses = [float("nan")] * len(answers)
    else:
        end_losses = reread_end_loss(system, probe) if system.mode.reread else answer_end_loss(system, probe)
    recalls = evidence_recall(probe, system.mode, retrieved)
    rows = []
    for answer, refs, path, depth, read, end_loss, recall in zip(answers, probe.references, probe.paths, probe.depth,
                                                                 reading, end_losses, recalls, strict=True):
        score = string_match_all([as_text(answer)], [[as_text(ref) for ref in refs]])
        rows.append({"system": system.name,
                     "variant": variant if variant != "variable_tracking" else f"{variant}_{hops}",
                     "multiplier": multiplier, "memory_tokens": probe.memory.size, "index": index,
                     "score": score, "exact": score == 1.0, "whole": is_whole_answer(answer, refs, path),
                     "depth_bin": min(int(depth * depth_bins), depth_bins - 1),
                     "end_loss": end_loss, "evidence_mass": read.get("evidence_mass", float("nan")),
                     "top_chunk": read.get("top_chunk", float("nan")), "evidence_recall": recall})
    return rows


def evidence_recall(probe: Probe, mode: MemoryMode, retrieved: list[list[int]] | None = None) -> list[float]:
    """Per question, for a system that puts chunks in its prompt (rag, dense_rag, in_context): 1.0 when every
    evidence chunk is there (the most it could answer from), else 0.0; NaN for gca (its reading: attention/...) and
    none. `retrieved`: the chunks an iterative rag retrieved for each question (reread_answers)."""
    if not mode.in_prompt:
        return [float("nan")] * len(probe.questions)
    kept = retrieved or chunks_in_prompt_each(probe.memory.tolist(), probe.questions, mode)
    return [float(held) for held in evidence_held(probe.evidence, kept)]


@torch.no_grad()
def memory_attention(system: System, probe: Probe) -> list[dict[str, float]]:
    """Memory-attention accuracy: at the question's last token (which predicts the first answer token), the share of
    GCA attention mass on the evidence chunks and whether the chunk read most is one of them, in the GCA layer that
    puts the most mass on the evidence (metrics.evidence_reading)."""
    inputs = {k: v.to(system.model.device) for k, v in system_prompts(probe, system.mode).items()}
    maps = probes.memory_attention(system.model, **inputs)  # per layer (questions, heads, M)
    length = probe.memory.shape[1]
    chunks = [(c * length, (c + 1) * length) for c in range(probe.memory.shape[0])]
    out = []
    for q, evidence in enumerate(probe.evidence):
        mass, top = evidence_reading([m[q] for m in maps], chunks, evidence)
        out.append({"evidence_mass": mass, "top_chunk": float(top)})
    return out


# ---------------------------------------------------------------------------------------------- the suite
class NeedleScorer:
    """A Ray Data actor: loads one system, scores batches of probe items."""

    def __init__(self, name: str, export: str, system: dict[str, Any], depth_bins: int, seed: int, use_gpu: bool,
                 served: str | None = None, tracking_uri: str | None = None, hard_distractors: float = 0.0,
                 store_dtype: str | None = None):
        self.system = load_system(name, export, system, "cuda" if use_gpu else "cpu", served, tracking_uri)
        if store_dtype is not None and self.system.served is None and self.system.mode.kind == "gca":
            read_memory_as_stored(self.system.model.memory_encoder, store_dtype, self.system.spec.chunk_len)
        self.depth_bins, self.seed, self.hard_distractors = depth_bins, seed, hard_distractors

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows: list[dict[str, Any]] = []
        for variant, multiplier, hops, index in zip(batch["variant"], batch["multiplier"], batch["hops"],
                                                    batch["index"], strict=True):
            rows += score_probe(self.system, str(variant), int(multiplier), self.seed, int(index), hops=int(hops),
                                depth_bins=self.depth_bins, hard_distractors=self.hard_distractors)
        return batch_columns(rows)


def reread_problems(settings: NeedleSuite, sources: list[Source]) -> list[str]:
    """needle.reread's names that name no system, or a system that does not retrieve (only rag and dense_rag do)."""
    kinds = {source.name: source.system.get("memory", "gca") for source in sources}
    problems = []
    for name in settings.reread:
        if name not in kinds:
            problems.append(f"needle.reread {name!r} names no system: the systems are {sorted(kinds)} (--names)")
        elif kinds[name] not in ("rag", "dense_rag"):
            problems.append(f"needle.reread {name!r} reads its memory as {kinds[name]}: only a rag or dense_rag "
                            f"system retrieves again")
    return problems


def scored_system(settings: NeedleSuite, source: Source) -> dict[str, Any]:
    """The source's system as the suite scores it: an iterative rag where its export trained as one
    (model.rag_reread) or needle.reread names it."""
    return {**source.system, "reread": bool(source.system.get("reread")) or source.name in settings.reread}


def needle_items(settings: NeedleSuite) -> list[dict[str, Any]]:
    items = []
    for variant in settings.variants:
        for multiplier in settings.multipliers:
            for hops in (settings.hops if variant == "variable_tracking" else [2]):
                items += [{"variant": variant, "multiplier": multiplier, "hops": hops, "index": i}
                          for i in range(settings.memories)]
    return items


def run_needles(settings: NeedleSuite, source: Source, workers: Workers) -> list[dict[str, Any]]:
    """Every probe's rows, as the actors score them, with a progress line (probes scored of all, elapsed, ETA)."""
    items = needle_items(settings)
    scored = map_with_actors(
        items_dataset(items, per_block=4), NeedleScorer, actors=workers.actors, batch_size=4,
        cpus_per_actor=workers.cpus_per_actor, use_gpu=workers.use_gpu,
        constructor_kwargs={"name": source.name, "export": source.export, "system": scored_system(settings, source),
                            "depth_bins": settings.depth_bins, "seed": settings.seed,
                            "hard_distractors": settings.hard_distractors, "store_dtype": settings.store_dtype,
                            "use_gpu": workers.use_gpu, "served": source.served, "tracking_uri": workers.tracking_uri})
    return collect_with_progress(scored.iter_rows(), Progress(f"{source.name}: needle", len(items)))


def collect_with_progress(rows: Iterable[dict[str, Any]], progress: Progress) -> list[dict[str, Any]]:
    """The scored rows, one per question, counting probes done (a probe's rows come back together) as they come."""
    out: list[dict[str, Any]] = []
    probes: set[tuple] = set()
    progress.update(0)
    for row in rows:
        out.append(dict(row))
        probe = (row["variant"], int(row["multiplier"]), int(row["index"]))
        if probe not in probes:
            probes.add(probe)
            progress.update(len(probes))
    if len(probes) < progress.total:  # a probe without questions (none here), or rows lost: say where it ended
        progress.update(progress.total)
    return out


def is_whole_answer(answer: list[int], references, path: list[int] = ()) -> bool:
    """The answer (cut at EOS) is the path (the keys a chain names), then the references' tokens one after another
    in some order, and nothing else."""
    return any(answer == [*path, *(token for ref in order for token in ref)]
               for order in itertools.permutations([list(ref) for ref in references]))


def needle_table(systems: dict[str, dict[str, Any]]) -> str:
    """The needle suite as one markdown table, every task a block of rows, one row per system, one column per memory
    size: `whole / match` (whole answers, RULER's match), and for rag and in_context their recall of the evidence
    (`r`); empty when no system ran the suite. `systems`: results.json's systems."""
    cells: dict[str, dict[str, dict[int, str]]] = {}
    sizes: set[int] = set()
    for system, entry in systems.items():
        metrics = entry.get("metrics", {})
        for name, value in metrics.items():
            parts = name.split("/")
            if len(parts) != 3 or parts[0] != "needle" or not isinstance(value, (int, float)):
                continue
            task, size = parts[1], int(parts[2].rstrip("x"))
            text = f"{metrics.get(f'{name}/whole_answer', float('nan')):.2f} / {value:.2f}"
            if f"{name}/evidence_recall" in metrics:
                text += f" (r {metrics[f'{name}/evidence_recall']:.2f})"
            cells.setdefault(task, {}).setdefault(system, {})[size] = text
            sizes.add(size)
    if not cells:
        return ""
    order = sorted(sizes)
    lines = ["| task | system | " + " | ".join(f"{m}x" for m in order) + " |", "|---|---|" + "---|" * len(order)]
    tasks = sorted(cells, key=lambda t: (VARIANTS.index(t) if t in VARIANTS else len(VARIANTS), t))
    for task in tasks:
        for system in systems:
            if system in cells[task]:
                row = cells[task][system]
                lines.append(f"| {task} | {system} | " + " | ".join(row.get(m, "-") for m in order) + " |")
    return "\n".join(lines) + "\n"


def needle_metrics(rows: list[dict[str, Any]], spec: NeedleSpec,
                   depth_bins: int) -> tuple[dict, dict, dict | None]:
    """metrics (rates with their 95% Wilson intervals), counts, and the single-needle heatmap (depth x size; None
    where single was not asked)."""
    metrics: dict[str, Any] = {}
    counts: dict[str, int] = {}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["variant"], int(row["multiplier"])), []).append(row)
    for (variant, multiplier), group in sorted(groups.items()):
        name = f"needle/{variant}/{multiplier}x"
        exact = sum(bool(r["exact"]) for r in group)
        metrics[name] = exact / len(group)
        metrics[f"{name}/ci95"] = list(rate_interval(exact, len(group)))
        metrics[f"{name}/string_match"] = sum(float(r["score"]) for r in group) / len(group)
        whole = sum(bool(r["whole"]) for r in group)
        metrics[f"{name}/whole_answer"] = whole / len(group)
        metrics[f"{name}/whole_answer/ci95"] = list(rate_interval(whole, len(group)))
        counts[name] = len(group)
        ends = [float(r["end_loss"]) for r in group if not math.isnan(r.get("end_loss", math.nan))]
        if ends:  # a local model's rows (a served pyfunc shows no logits)
            metrics[f"{name}/end_loss"] = sum(ends) / len(ends)
        recalled = [r["evidence_recall"] for r in group if not math.isnan(r.get("evidence_recall", math.nan))]
        if recalled:  # a rag or in_context system's rows: its retriever's recall of the evidence
            metrics[f"{name}/evidence_recall"] = sum(recalled) / len(recalled)
        read = [r for r in group if not math.isnan(r.get("evidence_mass", math.nan))]  # a gca system's rows
        if read:
            mass = sum(r["evidence_mass"] for r in read) / len(read)
            metrics[f"attention/{variant}/{multiplier}x/evidence_mass"] = mass
            top = sum(int(r["top_chunk"]) for r in read)
            metrics[f"attention/{variant}/{multiplier}x/top_chunk"] = top / len(read)
            metrics[f"attention/{variant}/{multiplier}x/top_chunk/ci95"] = list(rate_interval(top, len(read)))
    sizes = sorted({int(r["multiplier"]) for r in rows if r["variant"] == "single"})
    if not sizes:  # the heatmap is single's by depth: a suite that does not ask single has none
        return metrics, counts, None
    heatmap = {"memory_tokens": [memory_chunks(spec, m) * spec.chunk_len for m in sizes], "accuracy_by_depth": []}
    for b in range(depth_bins):
        line = []
        for m in sizes:
            cell = [r for r in groups.get(("single", m), []) if int(r["depth_bin"]) == b]
            line.append(sum(bool(r["exact"]) for r in cell) / len(cell) if cell else float("nan"))
        heatmap["accuracy_by_depth"].append(line)
    return metrics, counts, heatmap


class NeedleEvaluation:
    """The suite for every system: its probes on `workers.actors` actors, then its rates, counts and heatmap."""

    name: ClassVar[str] = "needle"

    def __init__(self, settings: NeedleSuite, workers: Workers):
        self.settings, self.workers = settings, workers

    def run(self, source: Source) -> SuiteResult:
        rows = run_needles(self.settings, source, self.workers)
        metrics, counts, heatmap = needle_metrics(rows, needle_spec(source.system), self.settings.depth_bins)
        single = {k: v for k, v in metrics.items() if k.startswith("needle/single/") and k.endswith("x")}
        line = f"{source.name}: needle " + "  ".join(
            f"{k.split('/')[-1]} {v:.2f} (whole {metrics[f'{k}/whole_answer']:.2f})" for k, v in single.items())
        return SuiteResult(metrics, counts, {"heatmaps": heatmap} if heatmap else {}, line)

    def close(self) -> None:
        pass
