"""Memories as resources for the Serve application (pipelines.serving.app): chunk texts encoded once by the model's own
encoder, named by a content hash, kept warm in an LRU with a byte budget, and written through to a memory store on disk
(pipelines.memory.store's format) so a restarted replica answers for a memory it had without re-encoding.

A memory belongs to the key that made it (its owner, pipelines.serving.app): its id is an HMAC keyed by the owner over
the encoder's identity (the fields a store is checked by, not the checkpoint's path or dtype) and the chunk texts.
The same chunks from one owner under one encoder are one memory, encoded once; the same chunks from another owner are
another memory, so nobody can compute or probe the id of what another owner stored. On disk a memory is
`MEMORY_DIR/<owner directory>/<id>/` (a store jobs/encode_memory.py could have written: store.json, chunks.jsonl,
states-*.safetensors), the owner directory a hash of the owner's name; every owner's directory has a disk budget.
Ids are 64 lowercase hex digits, checked before any path is made from one, so no request can name a path: the server
opens only directories under the MEMORY_DIR it was configured with.

What the cache holds per memory is what every question over it reads: the encoder states as the store gives them and
`AwarenessModel.prepare_memory`'s GCAMemory (the projection and each GCA layer's keys and values, computed once per
memory, not once per request). Its bytes count against the budget; the least recently used memories leave first
(they stay on disk).

A baseline (in_context, rag, none: pipelines.data.memory_modes) has no encoder to read with: its memories are
TextMemories, the chunk texts and their token ids, which every question puts in its prompt as training did. Same
ids (over the reading mode instead of an encoder, keyed by the owner), same routes, same directory rules.
"""

from __future__ import annotations

import hashlib
import hmac
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
    """No memory with that id for that owner, in the cache or on disk."""


class OverDiskBudget(ValueError):
    """A new memory would take its owner past the per-owner disk budget."""


def keyed_id(owner: str, content: dict[str, Any]) -> str:
    """HMAC-SHA256 keyed by the owner over the content (canonical JSON): 64 hex digits."""
    return hmac.new(owner.encode(), json.dumps(content, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def memory_id(identity: EncoderIdentity, chunks: list[str], owner: str) -> str:
    """The owner's id for these chunks under this encoder identity (its compared fields)."""
    who = {k: v for k, v in asdict(identity).items() if k not in EncoderIdentity.INFORMATIONAL}
    return keyed_id(owner, {"encoder": who, "chunks": chunks})


def owner_directory(owner: str) -> str:
    """The directory name of an owner's memories under MEMORY_DIR (a hash: an owner's name names no path)."""
    return hashlib.sha256(f"owner:{owner}".encode()).hexdigest()[:32]


def public_identity(identity: EncoderIdentity | None) -> dict[str, Any] | None:
    """The encoder identity a response may show: every field but the checkpoint's path on the server."""
    return None if identity is None else {k: v for k, v in asdict(identity).items() if k != "checkpoint"}


def disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()) if directory.is_dir() else 0


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
        return {"id": self.id, "object": "memory", "chunks": self.chunks, "tokens": self.tokens, "bytes": self.nbytes,
                "encoder": public_identity(self.encoder)}


class MemoryCache:
    """LRU of prepared memories under `budget_bytes`, written through to `directory`, at most `disk_budget_bytes` on
    disk per owner. `encode(chunk_ids)` gives each chunk's encoder states (tokens, H_enc) from its token ids;
    `prepare(store)` turns an opened store into a GCAMemory. Every call names the owner: another owner's memory is
    UnknownMemory, as an absent one is."""

    marker = MANIFEST  # the file that makes MEMORY_DIR/<id>/ a memory (written last)

    def __init__(self, directory: str | Path, budget_bytes: int, identity: EncoderIdentity, *, encode, prepare,
                 disk_budget_bytes: int | None = None):
        self.directory = Path(directory).expanduser().resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = int(budget_bytes)
        self.disk_budget_bytes = disk_budget_bytes
        self.identity = identity
        self._encode, self._prepare = encode, prepare
        self.entries: OrderedDict[tuple[str, str], Memory] = OrderedDict()  # (owner directory, id)
        self.lock = threading.RLock()
        self.counts = {"encoded": 0, "loaded": 0, "evicted": 0}

    def path(self, owner: str, id: str) -> Path:
        if not ID.match(id):
            raise UnknownMemory(id)
        return self.directory / owner_directory(owner) / id

    def create(self, owner: str, texts: list[str], chunk_ids: list[list[int]]) -> tuple[Memory, str]:
        """(memory, how: cache | disk | encoded) for these chunk texts, given their token ids (the caller tokenized
        them to check the memory's size: they are not tokenized again). OverDiskBudget when the owner's memories
        on disk would pass the disk budget (nothing is kept then)."""
        id = self.id_of(owner, texts)
        with self.lock:
            try:
                return self.get(owner, id)
            except UnknownMemory:
                pass
            home = self.directory / owner_directory(owner)
            home.mkdir(exist_ok=True)
            partial = home / f".{id}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            self._write(partial, texts, chunk_ids)
            if self.disk_budget_bytes is not None:
                used, adding = disk_bytes(home) - disk_bytes(partial), disk_bytes(partial)
                if used + adding > self.disk_budget_bytes:
                    shutil.rmtree(partial)
                    raise OverDiskBudget(f"this memory takes {adding} bytes on disk and its owner's memories take "
                                         f"{used} of the {self.disk_budget_bytes} bytes each key may keep")
            shutil.rmtree(home / id, ignore_errors=True)
            partial.replace(home / id)  # a memory on disk is whole or absent
            self.counts["encoded"] += 1
            return self._load(owner, id, chunk_ids), "encoded"

    def id_of(self, owner: str, texts: list[str]) -> str:
        return memory_id(self.identity, texts, owner)

    def _write(self, directory: Path, texts: list[str], chunk_ids: list[list[int]]) -> None:
        """These chunks encoded into a memory store at `directory`."""
        write(directory, [("memory", i, t) for i, t in enumerate(texts)], self._encode(chunk_ids), chunk_ids,
              self.identity, served=True)

    def get(self, owner: str, id: str) -> tuple[Memory, str]:
        """The owner's memory and where it came from (cache | disk); UnknownMemory (absent, or another owner's), or
        StoreMismatch (another encoder)."""
        with self.lock:
            key = (owner_directory(owner), id)
            if key in self.entries:
                self.entries.move_to_end(key)
                return self.entries[key], "cache"
            if not (self.path(owner, id) / self.marker).is_file():
                raise UnknownMemory(id)
            self.counts["loaded"] += 1
            return self._load(owner, id), "disk"

    def _load(self, owner: str, id: str, chunk_ids: list[list[int]] | None = None) -> Memory:
        """The memory on disk, read and made the most recently used (`chunk_ids`: its chunks' token ids when they
        are at hand, just written)."""
        memory = self._read(self.path(owner, id), id, chunk_ids)
        self.entries[(owner_directory(owner), id)] = memory
        self._evict()
        return memory

    def _read(self, path: Path, id: str, chunk_ids: list[list[int]] | None = None) -> Memory:
        store = MemoryStore(path)  # it holds the token ids itself
        store.check(self.identity)
        gca_memory = self._prepare(store)
        return Memory(id, len(store.chunks), int(store.manifest["tokens"]), store.identity, gca_memory,
                      tensor_bytes(gca_memory))

    def _evict(self) -> None:
        """Least recently used first, never the one just used (a memory over the whole budget still answers)."""
        while len(self.entries) > 1 and sum(m.nbytes for m in self.entries.values()) > self.budget_bytes:
            self.entries.popitem(last=False)
            self.counts["evicted"] += 1

    def delete(self, owner: str, id: str) -> None:
        with self.lock:
            path = self.path(owner, id)
            found = self.entries.pop((owner_directory(owner), id), None) is not None
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

    def __init__(self, directory: str | Path, budget_bytes: int, reads: str, *, tokenize,
                 disk_budget_bytes: int | None = None):
        super().__init__(directory, budget_bytes, None, encode=None, prepare=None, disk_budget_bytes=disk_budget_bytes)
        self.reads, self._tokenize = reads, tokenize

    def id_of(self, owner: str, texts: list[str]) -> str:
        return keyed_id(owner, {"reads": self.reads, "chunks": texts})

    def _write(self, directory: Path, texts: list[str], chunk_ids: list[list[int]]) -> None:
        directory.mkdir()
        (directory / self.marker).write_text(json.dumps({"reads": self.reads, "chunks": texts}))

    def _read(self, path: Path, id: str, chunk_ids: list[list[int]] | None = None) -> Memory:
        saved = json.loads((path / self.marker).read_text())
        if saved.get("reads") != self.reads:  # an id names its mode, so only a hand-edited file gets here
            raise StoreMismatch(f"memory {id} was made for a {saved.get('reads')} model; this one reads {self.reads}")
        texts = saved["chunks"]
        chunk_ids = chunk_ids if chunk_ids is not None else self._tokenize(texts)
        tokens = sum(len(ids) for ids in chunk_ids)
        return Memory(id, len(texts), tokens, None, None, 8 * tokens + sum(len(t) for t in texts), texts, chunk_ids)


__all__ = ["ID", "Memory", "MemoryCache", "OverDiskBudget", "StoreMismatch", "TextMemories", "UnknownMemory",
           "keyed_id", "memory_id", "owner_directory", "public_identity", "tensor_bytes"]
