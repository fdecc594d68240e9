"""Memories as resources for the Serve application (pipelines.serving.app): chunk texts encoded once by the model's own
encoder, named by a content hash, kept warm in an LRU with a byte budget, and written through to a memory store on disk
(pipelines.memory.store's format) so a restarted replica answers for a memory it had without re-encoding.

A memory's id is sha256 over the encoder's identity (the fields a store is checked by, not the checkpoint's path or
dtype) and the chunk texts: the same chunks under the same encoder are one memory, encoded once. On disk a memory is
`MEMORY_DIR/<id>/` (a store jobs/encode_memory.py could have written: store.json, chunks.jsonl, states-*.safetensors).
Ids are 64 lowercase hex digits, checked before any path is made from one, so no request can name a path: the server
opens only directories under the MEMORY_DIR it was configured with.

What the cache holds per memory is what every question over it reads: the encoder states as the store gives them and
`AwarenessModel.prepare_memory`'s GCAMemory (the projection and each GCA layer's keys and values, computed once per
memory, not once per request). Its bytes count against the budget; the least recently used memories leave first
(they stay on disk).

A baseline (in_context, rag, none: pipelines.data.memory_modes) has no encoder to read with: its memories are
TextMemories, the chunk texts and their token ids, which every question puts in its prompt as training did. Same
ids (over the reading mode instead of an encoder), same routes, same directory rules.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipelines.memory.store import MANIFEST, EncoderIdentity, MemoryStore, StoreMismatch, write

ID = re.compile(r"^[0-9a-f]{64}$")


class UnknownMemory(KeyError):
    """No memory with that id in the cache or on disk."""


def memory_id(identity: EncoderIdentity, chunks: list[str]) -> str:
    """sha256 of the encoder identity (its compared fields) and the chunk texts."""
    who = {k: v for k, v in asdict(identity).items() if k not in EncoderIdentity.INFORMATIONAL}
    return hashlib.sha256(json.dumps({"encoder": who, "chunks": chunks}, sort_keys=True).encode()).hexdigest()


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor reachable from a (nested) dataclass, dict, list or tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(value, f)) for f in value.__dataclass_fields__)
    return 0


@dataclass
class Memory:
    id: str
    chunks: int
    tokens: int
    encoder: EncoderIdentity | None  # None: a baseline's memory, read as text
    gca_memory: Any  # models.gca.GCAMemory (batch 1), read by every question over this memory; None for a baseline
    nbytes: int
    texts: list[str] | None = None  # a baseline's chunk texts, put in each question's prompt
    chunk_ids: list[list[int]] | None = None  # and their token ids

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "chunks": self.chunks, "tokens": self.tokens, "bytes": self.nbytes,
                "encoder": asdict(self.encoder) if self.encoder else None}


class MemoryCache:
    """LRU of prepared memories under `budget_bytes`, written through to `directory`. `encode(chunk_ids)` gives each
    chunk's encoder states (tokens, H_enc) from its token ids; `prepare(store)` turns an opened store into a
    GCAMemory."""

    marker = MANIFEST  # the file that makes MEMORY_DIR/<id>/ a memory (written last)

    def __init__(self, directory: str | Path, budget_bytes: int, identity: EncoderIdentity, *, encode, prepare):
        self.directory = Path(directory).expanduser().resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = int(budget_bytes)
        self.identity = identity
        self._encode, self._prepare = encode, prepare
        self.entries: OrderedDict[str, Memory] = OrderedDict()
        self.lock = threading.RLock()
        self.counts = {"encoded": 0, "loaded": 0, "evicted": 0}

    def path(self, id: str) -> Path:
        if not ID.match(id):
            raise UnknownMemory(id)
        return self.directory / id

    def create(self, texts: list[str], chunk_ids: list[list[int]]) -> tuple[Memory, str]:
        """(memory, how: cache | disk | encoded) for these chunk texts, given their token ids (the caller tokenized
        them to check the memory's size: they are not tokenized again)."""
        id = self.id_of(texts)
        with self.lock:
            try:
                return self.get(id)
            except UnknownMemory:
                pass
            partial = self.directory / f".{id}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            self._write(partial, texts, chunk_ids)
            shutil.rmtree(self.directory / id, ignore_errors=True)
            partial.replace(self.directory / id)  # a memory on disk is whole or absent
            self.counts["encoded"] += 1
            return self._load(id, chunk_ids), "encoded"

    def id_of(self, texts: list[str]) -> str:
        return memory_id(self.identity, texts)

    def _write(self, directory: Path, texts: list[str], chunk_ids: list[list[int]]) -> None:
        """These chunks encoded into a memory store at `directory`."""
        write(directory, [("memory", i, t) for i, t in enumerate(texts)], self._encode(chunk_ids), chunk_ids,
              self.identity, served=True)

    def get(self, id: str) -> tuple[Memory, str]:
        """The memory and where it came from (cache | disk); UnknownMemory, or StoreMismatch (another encoder)."""
        with self.lock:
            if id in self.entries:
                self.entries.move_to_end(id)
                return self.entries[id], "cache"
            if not (self.path(id) / self.marker).is_file():
                raise UnknownMemory(id)
            self.counts["loaded"] += 1
            return self._load(id), "disk"

    def _load(self, id: str, chunk_ids: list[list[int]] | None = None) -> Memory:
        """The memory on disk, read and made the most recently used (`chunk_ids`: its chunks' token ids when they
        are at hand, just written)."""
        memory = self._read(id, chunk_ids)
        self.entries[id] = memory
        self._evict()
        return memory

    def _read(self, id: str, chunk_ids: list[list[int]] | None = None) -> Memory:
        store = MemoryStore(self.path(id))  # it holds the token ids itself
        store.check(self.identity)
        gca_memory = self._prepare(store)
        return Memory(id, len(store.chunks), int(store.manifest["tokens"]), store.identity, gca_memory,
                      tensor_bytes(gca_memory))

    def _evict(self) -> None:
        """Least recently used first, never the one just used (a memory over the whole budget still answers)."""
        while len(self.entries) > 1 and sum(m.nbytes for m in self.entries.values()) > self.budget_bytes:
            self.entries.popitem(last=False)
            self.counts["evicted"] += 1

    def delete(self, id: str) -> None:
        with self.lock:
            path = self.path(id)
            found = self.entries.pop(id, None) is not None
            if (path / self.marker).is_file():
                shutil.rmtree(path)
                found = True
            if not found:
                raise UnknownMemory(id)


class TextMemories(MemoryCache):
    """A baseline's memories: chunk texts named by sha256 over the reading mode (`reads`: in_context, rag, none) and
    the texts, kept as MEMORY_DIR/<id>/chunks.json and warm under the same LRU budget with each chunk's token ids
    (given when made, `tokenize(texts)` when read back from disk by this model's tokenizer), tokenized once per
    memory, not once per question (8 bytes a token, and the texts)."""

    marker = "chunks.json"

    def __init__(self, directory: str | Path, budget_bytes: int, reads: str, *, tokenize):
        super().__init__(directory, budget_bytes, None, encode=None, prepare=None)
        self.reads, self._tokenize = reads, tokenize

    def id_of(self, texts: list[str]) -> str:
        return hashlib.sha256(json.dumps({"reads": self.reads, "chunks": texts}, sort_keys=True).encode()).hexdigest()

    def _write(self, directory: Path, texts: list[str], chunk_ids: list[list[int]]) -> None:
        directory.mkdir()
        (directory / self.marker).write_text(json.dumps({"reads": self.reads, "chunks": texts}))

    def _read(self, id: str, chunk_ids: list[list[int]] | None = None) -> Memory:
        saved = json.loads((self.path(id) / self.marker).read_text())
        if saved.get("reads") != self.reads:  # an id names its mode, so only a hand-edited file gets here
            raise StoreMismatch(f"memory {id} was made for a {saved.get('reads')} model; this one reads {self.reads}")
        texts = saved["chunks"]
        chunk_ids = chunk_ids if chunk_ids is not None else self._tokenize(texts)
        tokens = sum(len(ids) for ids in chunk_ids)
        return Memory(id, len(texts), tokens, None, None, 8 * tokens + sum(len(t) for t in texts), texts, chunk_ids)


__all__ = ["ID", "Memory", "MemoryCache", "StoreMismatch", "TextMemories", "UnknownMemory", "memory_id",
           "tensor_bytes"]
