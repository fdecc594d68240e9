"""Stage-0 rows, in two steps that the Ray Data pipeline runs on workers.

`file_records` (per file, parallel): read safely, parse with tree-sitter, chunk, tokenize chunks, extract facts.
`unit_rows` (per repository, after a group-by): keep facts whose answer is unique in the repository, build code
Q&A, document Q&A and needle rows with a memory budget (evidence chunks + distractors from the same repository),
direct or agentic (`<read>chunk</read>` for each evidence chunk, then the answer), tokenized (`rows.make_row`).

A fact's evidence chunks are the chunks that cover its `spans` (syntax.py, docs.py): for a method, the chunk of its
`class` line and the chunk of its `def` line, not every chunk in between. A row is made only if its answer stands
in its evidence chunks (`answer_parts`); a fact that cannot be used is counted by reason in `dropped`
(`DROP_REASONS`; the manifest's `dropped_facts`), never dropped silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from pipelines.corpora import docs, needles, sources, syntax
from pipelines.format import chunking
from pipelines.format.chunking import Chunk
from pipelines.format.rows import make_row
from pipelines.format.tokenizer import END_READ, READ

# Why a fact made no row (counted per repository; the manifest's `dropped_facts`):
#   not_unique              its name is asked about more than once in the repository (the answer would be ambiguous)
#   vague_definition        a document "definition" of "This", "The", ... (names nothing a question can ask about)
#   too_many_callers        "which functions call g" with more than 4 callers in one file
#   file_cap                the file already gave `max_facts_per_file` rows
#   no_evidence             no chunk covers its lines
#   answer_not_in_evidence  its answer does not stand in its evidence chunks (e.g. a definition wrapped inside a
#                           Markdown block quote, whose `>` markers the one-line answer drops)
#   evidence_over_budget    its evidence chunks alone exceed `max_chunks`
DROP_REASONS = ("not_unique", "vague_definition", "too_many_callers", "file_cap", "no_evidence",
                "answer_not_in_evidence", "evidence_over_budget")


@dataclass(frozen=True)
class Stage0Settings:
    chunk_tokens: int = 512  # memory chunk size (tokens, header included; ~, cut at syntax boundaries)
    max_chunks: int = 16  # memory budget per row: evidence chunks + distractors
    agentic_fraction: float = 0.5  # share of Q&A rows whose target reads the evidence chunk first
    max_facts_per_file: int = 12  # caps how much one large file dominates
    needles_per_unit: int = 10  # needle rows per repository (variants, depths and sizes cycled)
    needle_memory_sizes: tuple[int, ...] = (4, 8, 16)  # chunks per needle row's memory, in turn
    val_fraction: float = 0.1  # share of repositories (not rows) held out
    seed: int = 0  # with each row's identity, seeds its sampling: the same sources build the same corpus
    limits: sources.Limits = sources.Limits()


def unit_of(source: str, relpath: str, per_subdir: bool) -> str:
    """The repository a file belongs to: the source, or with per_subdir its first-level directory."""
    top = relpath.split(os.sep, 1)[0] if per_subdir and os.sep in relpath else ""
    return f"{source}/{top}" if top else source


def split_of(unit: str, val_fraction: float, seed: int) -> str:
    """A stable hash of the repository decides its split, so no repository is in both."""
    h = int(hashlib.sha256(f"{seed}:{unit}".encode()).hexdigest()[:8], 16) / 2**32
    return "val" if h < val_fraction else "train"


def stable_seed(*parts) -> int:
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def file_records(item: dict, tokenizer, settings: Stage0Settings) -> list[dict]:
    """One record per file (or per JSONL line): chunks and facts, or the reason it was rejected."""
    rel, kind, text, rejected = read_item(item, settings)
    if rejected:
        return rejected
    if kind == "jsonl":
        return jsonl_records(item, rel, text, tokenizer, settings)
    if kind in syntax.GRAMMARS:
        tree = syntax.parse(kind, text.encode("utf-8"))
        cuts = syntax.boundaries(tree)
        facts = syntax.facts(kind, tree, rel)
        chunks = chunking.chunk_file(rel, text, tokenizer, chunk_tokens=settings.chunk_tokens, boundaries=cuts)
        return [record(item, rel, kind, chunks=chunks, facts=facts, text=text)]
    return [document_record(item, rel, readable_text(rel, text), tokenizer, settings)]


def chunk_records(item: dict, tokenizer, settings: Stage0Settings, *, syntax_cuts: bool = True) -> list[dict]:
    """Chunks only (no facts): for memory-only builds, e.g. a repository's memory store or encoder pretraining.
    syntax_cuts=False cuts code at paragraph breaks instead of tree-sitter nodes, skipping the parse (which costs
    several times the tokenizing)."""
    rel, kind, text, rejected = read_item(item, settings)
    if rejected:
        return rejected
    if kind == "jsonl":  # one document per line, chunked as file_records does
        return jsonl_records(item, rel, text, tokenizer, settings)
    text = readable_text(rel, text)
    chunks = text_chunks(rel, text, tokenizer, settings.chunk_tokens, syntax_cuts=syntax_cuts)
    return [record(item, rel, kind, chunks=chunks, text=text)]


def readable_text(path: str, text: str) -> str:
    """What a memory holds of a file: an HTML page's text, any other file as it is."""
    return docs.html_to_text(text) if sources.kind_of(path) == "html" else text


def text_chunks(path: str, text: str, tokenizer, chunk_tokens: int, *,
                syntax_cuts: bool = True) -> list[chunking.Chunk]:
    """A file's memory chunks from its readable text, its kind read from the path (code cut at tree-sitter nodes):
    what a repository's memory holds, whether the file was read from disk or sent to the server."""
    kind = sources.kind_of(path)
    cuts = None
    if syntax_cuts and kind in syntax.GRAMMARS:
        cuts = syntax.boundaries(syntax.parse(kind, text.encode("utf-8")))
    return chunking.chunk_file(path, text, tokenizer, chunk_tokens=chunk_tokens, boundaries=cuts)


def read_item(item: dict, settings: Stage0Settings) -> tuple[str, str | None, str, list[dict]]:
    """A listed file's path, kind and text, or (as the last element) the reject record that stands for it."""
    root, rel = item["root"], item["path"]
    kind = sources.kind_of(rel)
    full = os.path.join(root, rel) if os.path.isdir(root) else root
    text, reason = sources.read_text(full, settings.limits, root)
    return rel, kind, text, [record(item, rel, kind, reject=reason)] if reason else []


def jsonl_records(item: dict, rel: str, text: str, tokenizer, settings: Stage0Settings) -> list[dict]:
    """One document record per JSONL line, or a reject record for a malformed line."""
    out = []
    for line, doc, why in sources.jsonl_documents(text, settings.limits.text_field):
        path = f"{rel}#L{line}"
        out.append(record(item, path, "markdown", reject=why) if why else
                   document_record(item, path, doc, tokenizer, settings))
    return out


def document_record(item, path, text, tokenizer, settings):
    chunks = chunking.chunk_file(path, text, tokenizer, chunk_tokens=settings.chunk_tokens)
    return record(item, path, "document", chunks=chunks, facts=docs.doc_facts(text, path), text=text)


def record(item: dict, path: str, kind: str | None, *, reject: str | None = None, chunks: list[Chunk] = (),
           facts: list[dict] = (), text: str = "") -> dict:
    return {
        "unit": item["unit"], "source": item["source"], "path": path, "kind": kind or "", "reject": reject or "",
        "chunk_texts": [c.text for c in chunks], "chunk_ids": [c.ids for c in chunks],
        "chunk_lines": [[c.start_line, c.end_line] for c in chunks],
        "facts": json.dumps(list(facts)), "tokens": sum(len(c.ids) for c in chunks), "bytes": len(text.encode()),
    }


def unit_chunks(records: list[dict]) -> list[Chunk]:
    out = []
    for r in records:
        for i, (text, ids, (s, e)) in enumerate(zip(r["chunk_texts"], r["chunk_ids"], r["chunk_lines"])):
            out.append(Chunk(r["path"], i, int(s), int(e), text, np.asarray(ids, dtype=np.int32)))
    return out


def unique_facts(records: list[dict], dropped: Counter | None = None) -> list[dict]:
    """Facts whose answer is determined within the repository: a name defined once, a method in one class, ...;
    call edges become "which functions in P call g" (one file's callers, evidence: their `def` (and `class`)
    lines and their calls of g). The others are counted in `dropped`."""
    dropped = Counter() if dropped is None else dropped
    facts = [f for r in records for f in json.loads(r["facts"])]
    counts = Counter((f["kind"], f["name"]) for f in facts if f["kind"] != "call_edge")
    defined = Counter(f["name"] for f in facts if f["kind"] == "defines")
    out = [f for f in facts if f["kind"] != "call_edge" and counts[(f["kind"], f["name"])] == 1]
    dropped["not_unique"] += sum(n for n in counts.values() if n > 1)
    vague = ("This", "The", "It", "A", "An")  # "This repository is ..." defines nothing a question can name
    kept = [f for f in out if f["kind"] != "definition" or f["name"].split()[0] not in vague]
    dropped["vague_definition"] += len(out) - len(kept)
    out = kept
    edges = defaultdict(list)
    for f in facts:
        if f["kind"] == "call_edge" and defined[f["name"]] == 1:
            edges[(f["path"], f["name"])].append(f)
    for (path, callee), group in sorted(edges.items()):
        callers = sorted({f["caller"] for f in group})
        if len(callers) > 4:
            dropped["too_many_callers"] += 1
            continue
        spans = syntax.merge_spans(s for f in group for s in fact_spans(f))
        out.append({"kind": "callers", "name": callee, "path": path, "start_line": spans[0][0],
                    "end_line": spans[-1][1], "spans": spans,
                    "question": f"Which functions in {path} call `{callee}`?", "answer": ", ".join(callers)})
    return out


def fact_spans(f: dict) -> list[list[int]]:
    """Where a fact's subject and answer stand (facts without `spans`, as older records: its one line span)."""
    return f.get("spans") or [[f["start_line"], f["end_line"]]]


def evidence_chunks(chunks: list[Chunk], f: dict) -> list[Chunk]:
    """The chunks of the fact's file that cover any of its spans, in file order, each once."""
    out = {c.index: c for s, e in fact_spans(f) for c in chunking.chunks_covering(chunks, f["path"], s, e)}
    return [out[i] for i in sorted(out)]


def answer_parts(f: dict) -> list[str]:
    """The pieces of a fact's answer that must each stand in its evidence: the answer itself, or for a list the
    items ("raises": exception names; "callers": each name of `Owner.method`, as the `class` and `def` lines say
    them), or for a constant its path (the chunk headers say it) and its assignment."""
    kind, answer = f["kind"], f["answer"]
    if kind == "raises":
        return answer.split(", ")
    if kind == "callers":
        return [part for caller in answer.split(", ") for part in caller.split(".")]
    if kind == "constant":
        return [f["path"], answer.removeprefix(f"{f['path']}: ")]
    return [answer]


def normalized(text: str) -> str:
    return " ".join(text.split())


def stands_in(parts: list[str], chunks: list[Chunk]) -> bool:
    """Every part is the chunks' path (their headers say it) or in their bodies read in order
    (whitespace-normalised: a document answer joins a wrapped sentence's lines)."""
    bodies = normalized("".join(c.text.split("\n", 1)[1] for c in chunks))
    paths = {c.path for c in chunks}
    return bool(chunks) and all(part in paths or normalized(part) in bodies for part in parts)


def unit_rows(records: list[dict], tokenizer, settings: Stage0Settings,
              dropped: Counter | None = None) -> Iterator[dict]:
    """Every stage-0 row of one repository, one at a time (the writer flushes shards as they fill); facts that
    make no row are counted by reason (DROP_REASONS) in `dropped`, as they are met."""
    if not records:
        return
    dropped = Counter() if dropped is None else dropped
    unit, source = records[0]["unit"], records[0]["source"]
    good = [r for r in records if not r["reject"]]
    pool = unit_chunks(good)
    if not pool:
        return
    by_path = defaultdict(list)
    for c in pool:
        by_path[c.path].append(c)
    per_file = Counter()
    for f in unique_facts(good, dropped):
        if per_file[f["path"]] >= settings.max_facts_per_file:
            dropped["file_cap"] += 1
            continue
        evidence = evidence_chunks(by_path[f["path"]], f)
        why = ("no_evidence" if not evidence else "answer_not_in_evidence" if not stands_in(answer_parts(f), evidence)
               else "evidence_over_budget" if len(evidence) > settings.max_chunks else None)
        if why:
            dropped[why] += 1
            continue
        per_file[f["path"]] += 1
        seed = stable_seed(settings.seed, unit, f["path"], f["kind"], f["name"])
        memory = chunking.select_memory(evidence, pool, settings.max_chunks, seed)
        names = [chunking.chunk_name(c.path, c.index) for c in evidence]
        task = "code_qa" if f["kind"] not in ("section", "definition") else "doc_qa"
        agentic = random.Random(seed).random() < settings.agentic_fraction
        target = [*reads(names), f["answer"]] if agentic else [f["answer"]]
        yield make_row(task=task, variant="agentic" if agentic else "direct", kind=f["kind"],
                       prompt=[f["question"], "\n"], target=target, answer=f["answer"],
                       memory=[c.text for c in memory], memory_ids=[c.ids for c in memory], source=source,
                       unit=unit, evidence=(f["path"], f["start_line"], f["end_line"]), evidence_chunks=names,
                       tokenizer=tokenizer)
    yield from needle_rows(pool, unit, source, tokenizer, settings)


def reads(names: list[str]) -> list[str]:
    """`<read>name</read>` for each chunk, in order: an agentic target reads every chunk its answer needs."""
    return [part for name in names for part in (READ, name, END_READ)]


def needle_rows(pool: list[Chunk], unit: str, source: str, tokenizer, settings: Stage0Settings) -> list[dict]:
    rows = []
    for k in range(settings.needles_per_unit):
        rng = random.Random(stable_seed(settings.seed, unit, "needle", k))
        variant = needles.VARIANTS[k % len(needles.VARIANTS)]
        size = min(settings.needle_memory_sizes[k % len(settings.needle_memory_sizes)], len(pool))
        depth = needles.DEPTHS[(k // len(needles.VARIANTS)) % len(needles.DEPTHS)] if size > 1 else 0.0
        haystack = rng.sample(pool, size)
        texts = [c.text for c in haystack]
        sentences, question, answer, _ = needles.make_needles(variant, rng, "".join(texts))
        where = needles.insert_needles(texts, sentences, depth, rng)
        ids = [tokenizer.encode_array(t) if i in where else c.ids for i, (t, c) in enumerate(zip(texts, haystack))]
        holder = haystack[where[0]]
        needed = dict.fromkeys(where[i] for i in needles.answer_needles(variant, len(sentences)))
        names = [chunking.chunk_name(haystack[i].path, haystack[i].index) for i in needed]
        agentic = rng.random() < settings.agentic_fraction
        rows.append(make_row(task="needle", variant=variant, kind="agentic" if agentic else "direct",
                             prompt=[question, "\n"], target=[*reads(names), answer] if agentic else [answer],
                             answer=answer, memory=texts, memory_ids=ids, source=source, unit=unit,
                             evidence=(holder.path, holder.start_line, holder.end_line), evidence_chunks=names,
                             tokenizer=tokenizer, depth=depth))
    return rows
