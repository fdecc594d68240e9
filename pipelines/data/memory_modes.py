"""How a system sees its memory: through GCA (`gca`), as text in its prompt (`in_context`, long context; `rag`, the
top-k chunks by BM25; `dense_rag`, the top-k chunks by a dense retriever trained on the same data), or not at all
(`none`). The baselines are data transforms, so they train and evaluate through
the same stage jobs, model and loss as `gca` (issue 14: does the memory beat RAG, long context and no memory at equal
data?).

For a prompt-memory system the chunks go before the prompt, labels ignored on them; the budget
counts memory tokens and keeps whole chunks, so truncation shows up as missing facts, not cut ones. RAG queries BM25
(`bm25s`) with the prompt's tokens over the example's own chunks, each chunk's tokens as its terms: ids are words, so
the same index works on needles (token-id vocabulary) and on tokenized corpus rows. Dense RAG embeds the prompt and
the chunks with a retriever export (models.retriever, trained by jobs/retriever.py) and takes the top k by cosine.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from pipelines.format.rows import IGNORE

MemoryKind = Literal["gca", "in_context", "rag", "dense_rag", "none"]
MEMORY_MODES: tuple[str, ...] = get_args(MemoryKind)
SYSTEM_FILE = "system.json"  # in a stage's export: how the model reads its memory, and the needle task it learned
RETRIEVER_DIR = "retriever"  # in a dense_rag reader's export: the retriever export it reads with, copied in


@dataclass(frozen=True)
class MemoryMode:
    kind: str = "gca"
    context_budget: int = 4096  # memory tokens placed in the prompt (in_context, rag, dense_rag)
    rag_k: int = 2  # chunks retrieved per question (rag, dense_rag)
    retriever: str | None = None  # dense_rag: a retriever export directory (jobs/retriever.py)
    # rag, dense_rag: retrieve rag_k chunks again at each key the answer names, and read on with them in the prompt
    # too (an iterative rag: model.rag_reread, or the needle suite's --needle.reread)
    reread: bool = False

    @property
    def in_prompt(self) -> bool:
        return self.kind in ("in_context", "rag", "dense_rag")

    def problems(self) -> list[str]:
        p = []
        if self.kind not in MEMORY_MODES:
            p.append(f"model.memory must be one of {MEMORY_MODES}, got {self.kind!r}")
        if self.context_budget <= 0:
            p.append("model.context_budget must be positive (memory tokens a prompt may hold)")
        if self.rag_k <= 0:
            p.append("model.rag_k must be positive (chunks retrieved per question)")
        if self.kind == "dense_rag":
            p += retriever_problems(self.retriever)
        if self.reread and self.kind not in ("rag", "dense_rag"):
            p.append(f"reread: only a retriever reads again (rag, dense_rag), not {self.kind}")
        return p


GCA, NO_MEMORY = MemoryMode("gca"), MemoryMode("none")  # the GCA system, and any model with its memory withheld


def _bm25s():
    """bm25s, imported on a rag query only. It runs a JAX op when imported, if JAX is installed: on a GPU box JAX
    then took 75% of the GPU in every process importing this module (an H200, 2026-11-26: the stage job ran out of
    memory), and its threads made every later fork of the stage driver (Ray's start) a deadlock risk. Its top-k on
    the CPU is all the rag baseline needs; a JAX_PLATFORMS set by the user wins."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s  # heavy and JAX-bound: see above

    return bm25s


def top_chunks(chunks: list[list[int]], query: list[int], k: int) -> list[int]:
    """Indices of the k chunks BM25 ranks highest for the query, best first (ties: memory order)."""
    return top_chunks_each(chunks, [query], k)[0]


def top_chunks_each(chunks: list[list[int]], queries: list[list[int]], k: int) -> list[list[int]]:
    """top_chunks for each of several queries over one memory, which BM25 then indexes once."""
    if not chunks:
        return [[] for _ in queries]
    k = min(k, len(chunks))
    retriever = _bm25s().BM25()
    retriever.index([[str(t) for t in chunk] or [""] for chunk in chunks], show_progress=False)
    ranked = []
    for query in queries:
        scores = retriever.get_scores([str(t) for t in query])  # (chunks,)
        order = np.argsort(-np.asarray(scores), kind="stable")
        ranked.append([int(i) for i in order[:k]])
    return ranked


def retriever_problems(retriever: str | None) -> list[str]:
    """What is wrong with a dense_rag run's --model.retriever (models.retriever, imported for a dense_rag config only:
    it imports transformers)."""
    from models.retriever import RETRIEVER_FILE

    if not retriever:
        return ["model.memory dense_rag retrieves with a trained retriever: pass --model.retriever EXPORT (the export "
                "of `python jobs/retriever.py`)"]
    if not (Path(retriever).expanduser() / RETRIEVER_FILE).is_file():
        return [f"model.retriever {retriever!r} holds no {RETRIEVER_FILE}: pass the export directory "
                f"`python jobs/retriever.py` printed"]
    return []


@functools.lru_cache(maxsize=2)
def _retriever(directory: str):
    """The retriever export, loaded once a process. models.retriever imports transformers: only on a dense_rag query,
    so a job's --help and config parsing stay fast."""
    from models.retriever import DenseRetriever  # heavy: transformers

    return DenseRetriever.from_pretrained(directory)


@functools.lru_cache(maxsize=8)
def _chunk_embeddings(directory: str, chunks: tuple[tuple[int, ...], ...]):
    """A memory's chunk embeddings (C, H), kept for the memory's next questions (a needle memory is asked several)."""
    from models.retriever import padded_rows  # heavy: see _retriever

    return _retriever(directory).scores_side(padded_rows([list(c) for c in chunks]))


def dense_top_chunks_each(chunks: list[list[int]], queries: list[list[int]], k: int,
                          retriever: str) -> list[list[int]]:
    """For each query, the indices of the k chunks the retriever export embeds closest (cosine), best first (ties:
    memory order)."""
    if not chunks:
        return [[] for _ in queries]
    from models.retriever import padded_rows, top_k  # heavy: see _retriever

    embedded = _chunk_embeddings(str(retriever), tuple(tuple(c) for c in chunks))  # (C, H)
    return top_k(_retriever(str(retriever)).scores_side(padded_rows(queries)) @ embedded.T, k)


def dense_top_chunks_many(memories: list[list[list[int]]], queries: list[list[list[int]]], k: int,
                          retriever: str) -> list[list[list[int]]]:
    """dense_top_chunks_each for several memories at once, each memory's queries ranked over its own chunks only.
    Every chunk and every query is embedded in one encoder pass a side: a training batch's memories are each new,
    so nothing is cached, and two small passes a memory were most of the cost of building its rows."""
    from models.retriever import padded_rows, top_k  # heavy: see _retriever

    model = _retriever(str(retriever))
    chunks_embedded = model.scores_side(padded_rows([c for chunks in memories for c in chunks]))  # (sum C, H)
    queries_embedded = model.scores_side(padded_rows([q for asked in queries for q in asked]))  # (sum Q, H)
    ranked, first_chunk, first_query = [], 0, 0
    for chunks, asked in zip(memories, queries, strict=True):
        own = chunks_embedded[first_chunk: first_chunk + len(chunks)]
        scores = queries_embedded[first_query: first_query + len(asked)] @ own.T
        ranked.append(top_k(scores, k) if chunks else [[] for _ in asked])
        first_chunk, first_query = first_chunk + len(chunks), first_query + len(asked)
    return ranked


def chunks_in_prompt(chunks: list[list[int]], query: list[int], mode: MemoryMode) -> list[int]:
    """Indices of the chunks a prompt-memory system puts before its prompt, in memory order: every chunk (in_context)
    or the retriever's top k (rag: BM25; dense_rag: the retriever export), whole chunks up to the budget; none for gca
    and none (the evaluation's retriever recall)."""
    return chunks_in_prompt_each(chunks, [query], mode)[0]


def chunks_in_prompt_each(chunks: list[list[int]], queries: list[list[int]], mode: MemoryMode) -> list[list[int]]:
    """chunks_in_prompt for each of several queries over one memory, which the retriever then indexes (BM25) or
    embeds (dense) once."""
    if mode.kind == "rag":
        orders = [sorted(top) for top in top_chunks_each(chunks, queries, mode.rag_k)]
    elif mode.kind == "dense_rag":
        orders = [sorted(top) for top in dense_top_chunks_each(chunks, queries, mode.rag_k, mode.retriever)]
    elif mode.kind == "in_context":
        orders = [list(range(len(chunks)))] * len(queries)
    else:
        return [[] for _ in queries]
    return [within_budget(chunks, order, mode.context_budget) for order in orders]


def chunks_read_each(chunks: list[list[int]], queries: list[list[int]], rereads: list[list[list[int]]],
                     mode: MemoryMode) -> list[list[int]]:
    """An iterative rag's chunks per query: its own (chunks_in_prompt_each) and those retrieved for each of its
    `rereads` queries (the keys its answer names, asked as a question asks them), memory order, within the budget."""
    first = chunks_in_prompt_each(chunks, queries, mode)
    flat = [query for again in rereads for query in again]
    more = iter(chunks_in_prompt_each(chunks, flat, mode) if flat else [])
    return [within_budget(chunks, sorted({*kept, *(c for _ in again for c in next(more))}), mode.context_budget)
            for kept, again in zip(first, rereads, strict=True)]


def evidence_held(evidence: list[list[int]], kept: list[list[int]]) -> list[bool]:
    """Per question, whether every chunk its evidence lies in is among the chunks kept for it (what a reader given
    those chunks could answer from)."""
    return [set(chunks) <= set(top) for chunks, top in zip(evidence, kept, strict=True)]


def within_budget(chunks: list[list[int]], order: list[int], budget: int) -> list[int]:
    """The chunks of `order`, whole, while their tokens fit the budget."""
    kept, used = [], 0
    for i in order:
        if used + len(chunks[i]) > budget:
            break
        kept.append(i)
        used += len(chunks[i])
    return kept


def prompt_memories_many(memories: list[list[list[int]]], queries: list[list[list[int]]],
                         mode: MemoryMode) -> list[list[list[int]]]:
    """prompt_memories for each of several memories and its queries; dense_rag embeds them all at once
    (dense_top_chunks_many), the other systems take them one memory at a time."""
    if mode.kind != "dense_rag":
        return [prompt_memories(chunks, asked, mode) for chunks, asked in zip(memories, queries, strict=True)]
    tops = dense_top_chunks_many(memories, queries, mode.rag_k, mode.retriever)
    return [[[t for i in within_budget(chunks, sorted(top), mode.context_budget) for t in chunks[i]] for top in ranked]
            for chunks, ranked in zip(memories, tops, strict=True)]


def prompt_memory(chunks: list[list[int]], query: list[int], mode: MemoryMode) -> list[int]:
    """The memory tokens a prompt-memory system puts before its prompt (chunks_in_prompt's, one after another).
    Chunks come unpadded (corpus rows and needle memories both are): no id is taken for padding, since Qwen3's id 0
    is `!`, a real token of code."""
    return prompt_memories(chunks, [query], mode)[0]


def prompt_memories(chunks: list[list[int]], queries: list[list[int]], mode: MemoryMode) -> list[list[int]]:
    """prompt_memory for each of several queries over one memory (chunks_in_prompt_each)."""
    return [[t for i in kept for t in chunks[i]] for kept in chunks_in_prompt_each(chunks, queries, mode)]


def memory_into_prompt(example: dict, mode: MemoryMode) -> dict:
    """A corpus row for a prompt-memory (or no-memory) system: its chunks in the prompt (or dropped), no memory.
    The query is the prompt, the tokens before the first label."""
    if mode.kind == "gca":
        return example
    input_ids, labels = list(example["input_ids"]), list(example["labels"])
    prompt_len = next((i for i, label in enumerate(labels) if label != IGNORE), len(labels))
    chunks = [list(chunk) for chunk in example["memory_input_ids"]]
    memory = prompt_memory(chunks, input_ids[:prompt_len], mode)
    return {**example, "input_ids": memory + input_ids, "labels": [IGNORE] * len(memory) + labels,
            "memory_input_ids": []}


def read_system(export_dir: str | Path) -> dict[str, Any]:
    """An export's system.json, its retriever's directory inside the export made a path; an export written before
    baselines existed reads its memory through GCA."""
    path = Path(export_dir) / SYSTEM_FILE
    if not path.is_file():
        return {"memory": "gca", "needle": None}
    system = json.loads(path.read_text())
    if system.get("retriever"):
        system["retriever"] = str(Path(export_dir) / system["retriever"])
    return system


def system_mode(system: dict[str, Any]) -> MemoryMode:
    return MemoryMode(system.get("memory", "gca"), context_budget=system.get("context_budget", 4096),
                      rag_k=system.get("rag_k", 2), retriever=system.get("retriever"),
                      reread=system.get("reread", False))
