"""How a system sees its memory: through GCA (`gca`), as text in its prompt (`in_context`, long context; `rag`, the
top-k chunks by BM25), or not at all (`none`). The baselines are data transforms, so they train and evaluate through
the same stage jobs, model and loss as `gca` (issue 14: does the memory beat RAG, long context and no memory at equal
data?).

For a prompt-memory system the chunks go before the prompt, labels ignored on them; the budget
counts memory tokens and keeps whole chunks, so truncation shows up as missing facts, not cut ones. RAG queries BM25
(`bm25s`) with the prompt's tokens over the example's own chunks, each chunk's tokens as its terms: ids are words, so
the same index works on needles (token-id vocabulary) and on tokenized corpus rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from pipelines.format.rows import IGNORE

MemoryKind = Literal["gca", "in_context", "rag", "none"]
MEMORY_MODES: tuple[str, ...] = get_args(MemoryKind)
SYSTEM_FILE = "system.json"  # in a stage's export: how the model reads its memory, and the needle task it learned


@dataclass(frozen=True)
class MemoryMode:
    kind: str = "gca"
    context_budget: int = 4096  # memory tokens placed in the prompt (in_context, rag)
    rag_k: int = 2  # chunks retrieved per question (rag)

    @property
    def in_prompt(self) -> bool:
        return self.kind in ("in_context", "rag")

    def problems(self) -> list[str]:
        p = []
        if self.kind not in MEMORY_MODES:
            p.append(f"model.memory must be one of {MEMORY_MODES}, got {self.kind!r}")
        if self.context_budget <= 0:
            p.append("model.context_budget must be positive (memory tokens a prompt may hold)")
        if self.rag_k <= 0:
            p.append("model.rag_k must be positive (chunks retrieved per question)")
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


def chunks_in_prompt(chunks: list[list[int]], query: list[int], mode: MemoryMode) -> list[int]:
    """Indices of the chunks a prompt-memory system puts before its prompt, in memory order: every chunk (in_context)
    or BM25's top k (rag), whole chunks up to the budget; none for gca and none (the evaluation's retriever recall)."""
    if mode.kind == "rag":
        order = sorted(top_chunks(chunks, query, mode.rag_k))
    elif mode.kind == "in_context":
        order = list(range(len(chunks)))
    else:
        return []
    kept, used = [], 0
    for i in order:
        if used + len(chunks[i]) > mode.context_budget:
            break
        kept.append(i)
        used += len(chunks[i])
    return kept


def prompt_memory(chunks: list[list[int]], query: list[int], mode: MemoryMode) -> list[int]:
    """The memory tokens a prompt-memory system puts before its prompt (chunks_in_prompt's, one after another).
    Chunks come unpadded (corpus rows and needle memories both are): no id is taken for padding, since Qwen3's id 0
    is `!`, a real token of code."""
    return [t for i in chunks_in_prompt(chunks, query, mode) for t in chunks[i]]


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
    """An export's system.json; an export written before baselines existed reads its memory through GCA."""
    path = Path(export_dir) / SYSTEM_FILE
    return json.loads(path.read_text()) if path.is_file() else {"memory": "gca", "needle": None}


def system_mode(system: dict[str, Any]) -> MemoryMode:
    return MemoryMode(system.get("memory", "gca"), context_budget=system.get("context_budget", 4096),
                      rag_k=system.get("rag_k", 2))
