"""Stage-0 rows, in two steps that the Ray Data pipeline runs on workers.

`file_records` (per file, parallel): read safely, parse with tree-sitter, chunk, tokenize chunks, extract facts.
`unit_rows` (per repository, after a group-by): keep facts whose answer is unique in the repository, build code
Q&A, document Q&A and needle rows with a memory budget (evidence chunks + distractors from the same repository),
direct or agentic (`<read>chunk</read>` then the answer), tokenized (`rows.tokenize_row`).
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

from pipelines.data.corpora import chunking, docs, needles, sources, syntax
from pipelines.data.corpora.chunking import Chunk
from pipelines.data.corpora.rows import make_row
from pipelines.data.tokenizer import END_READ, READ


@dataclass(frozen=True)
class Stage0Settings:
    chunk_tokens: int = 512  # memory chunk size (tokens, header included; ~, cut at syntax boundaries)
    max_chunks: int = 16  # memory budget per row: evidence chunks + distractors
    agentic_fraction: float = 0.5  # share of Q&A rows whose target reads the evidence chunk first
    max_facts_per_file: int = 12  # caps how much one large file dominates
    needles_per_unit: int = 10  # needle rows per repository (variants, depths and sizes cycled)
    needle_memory_sizes: tuple[int, ...] = (4, 8, 16)
    val_fraction: float = 0.1  # share of repositories (not rows) held out
    seed: int = 0
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
    if kind == "html":
        text = docs.html_to_text(text)
    return [document_record(item, rel, text, tokenizer, settings)]


def chunk_records(item: dict, tokenizer, settings: Stage0Settings, *, syntax_cuts: bool = True) -> list[dict]:
    """Chunks only (no facts): for memory-only builds, e.g. a repository's memory store or encoder pretraining.
    syntax_cuts=False cuts code at paragraph breaks instead of tree-sitter nodes, skipping the parse (which costs
    several times the tokenizing)."""
    rel, kind, text, rejected = read_item(item, settings)
    if rejected:
        return rejected
    if kind == "jsonl":  # one document per line, chunked as file_records does
        return jsonl_records(item, rel, text, tokenizer, settings)
    if kind == "html":
        text = docs.html_to_text(text)
    cuts = syntax.boundaries(syntax.parse(kind, text.encode("utf-8"))) if syntax_cuts and kind in syntax.GRAMMARS else None
    chunks = chunking.chunk_file(rel, text, tokenizer, chunk_tokens=settings.chunk_tokens, boundaries=cuts)
    return [record(item, rel, kind, chunks=chunks, text=text)]


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


def unique_facts(records: list[dict]) -> list[dict]:
    """Facts whose answer is determined within the repository: a name defined once, a method in one class, ...;
    call edges become "which functions in P call g" (one file's callers, evidence spanning them)."""
    facts = [f for r in records for f in json.loads(r["facts"])]
    counts = Counter((f["kind"], f["name"]) for f in facts if f["kind"] != "call_edge")
    defined = Counter(f["name"] for f in facts if f["kind"] == "defines")
    out = [f for f in facts if f["kind"] != "call_edge" and counts[(f["kind"], f["name"])] == 1]
    vague = ("This", "The", "It", "A", "An")  # "This repository is ..." defines nothing a question can name
    out = [f for f in out if f["kind"] != "definition" or f["name"].split()[0] not in vague]
    edges = defaultdict(list)
    for f in facts:
        if f["kind"] == "call_edge" and defined[f["name"]] == 1:
            edges[(f["path"], f["name"])].append(f)
    for (path, callee), group in sorted(edges.items()):
        callers = sorted({f["caller"] for f in group})
        if len(callers) <= 4:
            out.append({"kind": "callers", "name": callee, "path": path,
                        "start_line": min(f["start_line"] for f in group),
                        "end_line": max(f["end_line"] for f in group),
                        "question": f"Which functions in {path} call `{callee}`?", "answer": ", ".join(callers)})
    return out


def unit_rows(records: list[dict], tokenizer, settings: Stage0Settings) -> Iterator[dict]:
    """Every stage-0 row of one repository, one at a time (the writer flushes shards as they fill)."""
    if not records:
        return
    unit, source = records[0]["unit"], records[0]["source"]
    good = [r for r in records if not r["reject"]]
    pool = unit_chunks(good)
    if not pool:
        return
    by_path = defaultdict(list)
    for c in pool:
        by_path[c.path].append(c)
    per_file = Counter()
    for f in unique_facts(good):
        if per_file[f["path"]] >= settings.max_facts_per_file:
            continue
        evidence = chunking.chunks_covering(by_path[f["path"]], f["path"], f["start_line"], f["end_line"])
        if not evidence:
            continue
        per_file[f["path"]] += 1
        seed = stable_seed(settings.seed, unit, f["path"], f["kind"], f["name"])
        memory = chunking.select_memory(evidence, pool, settings.max_chunks, seed)
        read = chunking.chunks_covering(evidence, f["path"], f["start_line"], f["start_line"]) or evidence
        task = "code_qa" if f["kind"] not in ("section", "definition") else "doc_qa"
        agentic = random.Random(seed).random() < settings.agentic_fraction
        target = ([READ, chunking.chunk_name(read[0].path, read[0].index), END_READ, f["answer"]] if agentic
                  else [f["answer"]])
        yield make_row(task=task, variant="agentic" if agentic else "direct", kind=f["kind"],
                       prompt=[f["question"], "\n"], target=target, answer=f["answer"],
                       memory=[c.text for c in memory], memory_ids=[c.ids for c in memory], source=source,
                       unit=unit, evidence=(f["path"], f["start_line"], f["end_line"]), tokenizer=tokenizer)
    yield from needle_rows(pool, unit, source, tokenizer, settings)


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
        read = chunking.chunk_name(holder.path, holder.index)
        agentic = rng.random() < settings.agentic_fraction
        rows.append(make_row(task="needle", variant=variant, kind="agentic" if agentic else "direct",
                             prompt=[question, "\n"], target=[READ, read, END_READ, answer] if agentic else [answer],
                             answer=answer, memory=texts, memory_ids=ids, source=source, unit=unit,
                             evidence=(holder.path, holder.start_line, holder.end_line), tokenizer=tokenizer,
                             depth=depth))
    return rows
