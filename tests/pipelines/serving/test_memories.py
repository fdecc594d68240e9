"""The Serve app's memory cache (pipelines/serving/memories.py) without a model: ids by content, one encoding per
memory, the byte budget's LRU, the disk copy a restarted cache reads, and ids that cannot name a path."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from dataclasses import dataclass

import pytest
import torch

from pipelines.memory.store import EncoderIdentity, StoreMismatch
from pipelines.serving.memories import (MemoryCache, OverDiskBudget, TextMemories, UnknownMemory, memory_id,
                                        owner_directory, tensor_bytes)

IDENTITY = EncoderIdentity("enc", "c" * 64, "w" * 64, None, "causal", 4, "float32")
OWNER = "alice"
PREPARED_BYTES = 400  # what prepare() below holds per memory: a (10, 10) float32


def cache(directory, budget_bytes: int, encoded: list[list[str]]) -> MemoryCache:
    """A cache whose encoder gives each chunk (tokens = its ids, H_enc = 4) and records every call."""

    def encode(chunk_ids):
        encoded.append([len(ids) for ids in chunk_ids])
        return [torch.full((len(ids), 4), float(i)) for i, ids in enumerate(chunk_ids)]

    return MemoryCache(directory, budget_bytes, IDENTITY, encode=encode,
                       prepare=lambda store: {"kv": torch.zeros(10, 10)})


def ids(texts: list[str]) -> list[list[int]]:
    """The chunks' token ids as the app gives them to create (here one 7 a character)."""
    return [[7] * len(t) for t in texts]


def held(memories: MemoryCache) -> list[str]:
    """The ids in the cache, least recently used first."""
    return [id for _, id in memories.entries]


@dataclass
class Holder:
    a: torch.Tensor
    rest: list


def test_tensor_bytes_counts_every_nested_tensor():
    value = {"x": torch.zeros(2, 3),  # 6 float32: 24 bytes
             "y": Holder(torch.zeros(4, dtype=torch.int64), [torch.zeros(5, dtype=torch.bfloat16), "text", 3])}
    assert tensor_bytes(value) == 24 + 32 + 10


def test_the_id_is_the_owner_the_encoder_and_the_chunks():
    chunks = ["def f(): pass", "x = 1"]
    id = memory_id(IDENTITY, chunks, OWNER)
    assert len(id) == 64 and set(id) <= set("0123456789abcdef")
    assert memory_id(dataclasses.replace(IDENTITY, checkpoint="moved", dtype="bfloat16"), chunks, OWNER) == id
    assert memory_id(dataclasses.replace(IDENTITY, weights_sha256="v" * 64), chunks, OWNER) != id
    assert memory_id(IDENTITY, chunks[::-1], OWNER) != id
    assert memory_id(IDENTITY, chunks, "bob") != id  # keyed by the owner: nobody computes another owner's id
    who = {k: v for k, v in dataclasses.asdict(IDENTITY).items() if k not in ("checkpoint", "dtype")}
    payload = json.dumps({"encoder": who, "chunks": chunks}, sort_keys=True).encode()
    assert id == hmac.new(OWNER.encode(), payload, hashlib.sha256).hexdigest()  # HMAC-SHA256, the owner its key


def test_another_owners_memory_is_absent_to_them_and_the_same_text_is_their_own_memory(tmp_path):
    encoded = []
    memories = cache(tmp_path, 10 * PREPARED_BYTES, encoded)
    mine, how = memories.create(OWNER, ["abc"], ids(["abc"]))
    for call in (memories.get, memories.delete):
        with pytest.raises(UnknownMemory):
            call("bob", mine.id)
    theirs, how = memories.create("bob", ["abc"], ids(["abc"]))
    assert how == "encoded" and theirs.id != mine.id and len(encoded) == 2  # the same status as a new text
    assert (tmp_path / owner_directory(OWNER) / mine.id).is_dir()
    assert (tmp_path / owner_directory("bob") / theirs.id).is_dir()
    assert memories.get(OWNER, mine.id)[0] is mine


def test_an_owners_disk_budget_refuses_the_memory_that_would_pass_it_and_keeps_nothing_of_it(tmp_path):
    memories = cache(tmp_path, 10 * PREPARED_BYTES, [])
    first = memories.create(OWNER, ["a" * 50], ids(["a" * 50]))[0]
    used = sum(f.stat().st_size for f in (tmp_path / owner_directory(OWNER)).rglob("*") if f.is_file())
    memories.disk_budget_bytes = used + used // 2  # room for half another one
    with pytest.raises(OverDiskBudget, match="bytes each key may keep"):
        memories.create(OWNER, ["b" * 50], ids(["b" * 50]))
    assert [p.name for p in (tmp_path / owner_directory(OWNER)).iterdir()] == [first.id]
    assert memories.create("bob", ["b" * 50], ids(["b" * 50]))[1] == "encoded"  # a budget per owner


def test_a_memory_is_encoded_once_then_read_from_the_cache(tmp_path):
    encoded = []
    memories = cache(tmp_path, 10 * PREPARED_BYTES, encoded)
    memory, how = memories.create(OWNER, ["abc", "de"], ids(["abc", "de"]))
    assert how == "encoded" and encoded == [[3, 2]]  # the token ids given, encoded once
    assert (memory.chunks, memory.tokens, memory.nbytes) == (2, 5, PREPARED_BYTES)
    again, how = memories.create(OWNER, ["abc", "de"], ids(["abc", "de"]))
    assert how == "cache" and again is memory and len(encoded) == 1
    assert memories.get(OWNER, memory.id)[1] == "cache"


def test_the_least_recently_used_leave_the_budget_and_stay_on_disk(tmp_path):
    encoded = []
    memories = cache(tmp_path, 2 * PREPARED_BYTES + 1, encoded)  # two memories fit
    a, b, c = (memories.create(OWNER, [text], ids([text]))[0] for text in ("a", "bb", "ccc"))
    assert held(memories) == [b.id, c.id] and memories.counts["evicted"] == 1
    memories.get(OWNER, b.id)  # b is now the most recent: d pushes c out
    d = memories.create(OWNER, ["dddd"], ids(["dddd"]))[0]
    assert held(memories) == [b.id, d.id]
    assert memories.get(OWNER, a.id)[1] == "disk" and memories.counts["loaded"] == 1
    assert len(encoded) == 4  # read back from disk, not encoded again
    restarted = cache(tmp_path, 10 * PREPARED_BYTES, encoded)  # a new replica over the same directory
    assert restarted.get(OWNER, c.id)[0].tokens == 3


def test_a_memory_over_the_whole_budget_still_answers(tmp_path):
    memories = cache(tmp_path, PREPARED_BYTES // 2, [])
    a = memories.create(OWNER, ["a"], ids(["a"]))[0]
    assert held(memories) == [a.id]
    b = memories.create(OWNER, ["b"], ids(["b"]))[0]
    assert held(memories) == [b.id]


def test_ids_that_are_not_hashes_name_no_path(tmp_path):
    memories = cache(tmp_path / "memories", PREPARED_BYTES, [])
    (tmp_path / "secret").mkdir()
    for id in ("../secret", "A" * 64, "0" * 63, ""):
        with pytest.raises(UnknownMemory):
            memories.get(OWNER, id)
    with pytest.raises(UnknownMemory):
        memories.get(OWNER, "0" * 64)  # well formed, never created


def test_delete_removes_the_cached_and_the_disk_copy(tmp_path):
    memories = cache(tmp_path, 10 * PREPARED_BYTES, [])
    memory = memories.create(OWNER, ["abc"], ids(["abc"]))[0]
    memories.delete(OWNER, memory.id)
    assert not (tmp_path / owner_directory(OWNER) / memory.id).exists()
    with pytest.raises(UnknownMemory):
        memories.get(OWNER, memory.id)
    with pytest.raises(UnknownMemory):
        memories.delete(OWNER, memory.id)


def test_a_store_from_another_encoder_is_refused(tmp_path):
    memory = cache(tmp_path, 10 * PREPARED_BYTES, []).create(OWNER, ["abc"], ids(["abc"]))[0]
    other = dataclasses.replace(IDENTITY, config_sha256="d" * 64)
    reader = MemoryCache(tmp_path, PREPARED_BYTES, other, encode=None, prepare=lambda store: {})
    with pytest.raises(StoreMismatch):
        reader.get(OWNER, memory.id)


def test_a_baselines_memories_are_its_texts_kept_on_disk_and_named_by_its_reading(tmp_path):
    """TextMemories (in_context / rag / none): the chunk texts, encoded by nothing; the same texts are one memory for
    one reading mode and another for another; a new cache (a restarted replica) reads them back from disk; the LRU
    budget evicts them as it does encoded ones; a file made for another mode is refused."""
    tokenized = []

    def tokenize(texts):
        tokenized.append(texts)
        return [t.split() for t in texts]

    rag = TextMemories(tmp_path, 10_000, "rag", tokenize=tokenize)
    texts = ["k1 = 1 2 3 ;", "k2 = 4 5 6 ;"]
    memory, how = rag.create(OWNER, texts, [t.split() for t in texts])
    assert how == "encoded" and (memory.chunks, memory.tokens, memory.encoder, memory.gca_memory) == (2, 12, None, None)
    assert memory.texts == texts and memory.describe()["encoder"] is None
    assert memory.chunk_ids == [["k1", "=", "1", "2", "3", ";"], ["k2", "=", "4", "5", "6", ";"]]
    assert rag.create(OWNER, texts, [t.split() for t in texts]) == (memory, "cache")
    assert rag.get(OWNER, memory.id)[1] == "cache"
    assert tokenized == []  # the ids the app tokenized to check the size: not tokenized again, nor for each question
    in_context = TextMemories(tmp_path, 10_000, "in_context", tokenize=tokenize)
    assert in_context.create(OWNER, texts, [t.split() for t in texts])[0].id != memory.id
    restarted = TextMemories(tmp_path, 10_000, "rag", tokenize=tokenize)
    reread, how = restarted.get(OWNER, memory.id)
    assert how == "disk" and reread.texts == memory.texts and reread.chunk_ids == memory.chunk_ids
    assert tokenized == [texts]  # read back from disk: tokenized by this model's tokenizer, once
    with pytest.raises(StoreMismatch, match="made for a rag model; this one reads in_context"):
        in_context.get(OWNER, memory.id)
    small = TextMemories(tmp_path, 1, "rag", tokenize=tokenize)
    first = small.create(OWNER, ["a b"], ids(["a b"]))[0]
    small.create(OWNER, ["c d"], ids(["c d"]))
    assert held(small) != [first.id] and first.id not in held(small) and small.counts["evicted"] == 1
    small.delete(OWNER, first.id)
    with pytest.raises(UnknownMemory):
        small.get(OWNER, first.id)
