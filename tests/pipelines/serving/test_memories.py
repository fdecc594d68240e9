"""The Serve app's memory cache (pipelines/serving/memories.py) without a model: ids by content, one encoding per
memory, the byte budget's LRU, the disk copy a restarted cache reads, and ids that cannot name a path."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from pipelines.memory.store import EncoderIdentity, StoreMismatch
from pipelines.serving.memories import MemoryCache, TextMemories, UnknownMemory, memory_id, tensor_bytes

IDENTITY = EncoderIdentity("enc", "c" * 64, "w" * 64, None, "causal", 4, "float32")
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


@dataclass
class Holder:
    a: torch.Tensor
    rest: list


def test_tensor_bytes_counts_every_nested_tensor():
    value = {"x": torch.zeros(2, 3),  # 6 float32: 24 bytes
             "y": Holder(torch.zeros(4, dtype=torch.int64), [torch.zeros(5, dtype=torch.bfloat16), "text", 3])}
    assert tensor_bytes(value) == 24 + 32 + 10


def test_the_id_is_the_encoder_and_the_chunks():
    chunks = ["def f(): pass", "x = 1"]
    id = memory_id(IDENTITY, chunks)
    assert len(id) == 64 and set(id) <= set("0123456789abcdef")
    assert memory_id(dataclasses.replace(IDENTITY, checkpoint="moved", dtype="bfloat16"), chunks) == id
    assert memory_id(dataclasses.replace(IDENTITY, weights_sha256="v" * 64), chunks) != id
    assert memory_id(IDENTITY, chunks[::-1]) != id


def test_a_memory_is_encoded_once_then_read_from_the_cache(tmp_path):
    encoded = []
    memories = cache(tmp_path, 10 * PREPARED_BYTES, encoded)
    memory, how = memories.create(["abc", "de"], ids(["abc", "de"]))
    assert how == "encoded" and encoded == [[3, 2]]  # the token ids given, encoded once
    assert (memory.chunks, memory.tokens, memory.nbytes) == (2, 5, PREPARED_BYTES)
    again, how = memories.create(["abc", "de"], ids(["abc", "de"]))
    assert how == "cache" and again is memory and len(encoded) == 1
    assert memories.get(memory.id)[1] == "cache"


def test_the_least_recently_used_leave_the_budget_and_stay_on_disk(tmp_path):
    encoded = []
    memories = cache(tmp_path, 2 * PREPARED_BYTES + 1, encoded)  # two memories fit
    a, b, c = (memories.create([text], ids([text]))[0] for text in ("a", "bb", "ccc"))
    assert list(memories.entries) == [b.id, c.id] and memories.counts["evicted"] == 1
    memories.get(b.id)  # b is now the most recent: d pushes c out
    d = memories.create(["dddd"], ids(["dddd"]))[0]
    assert list(memories.entries) == [b.id, d.id]
    assert memories.get(a.id)[1] == "disk" and memories.counts["loaded"] == 1
    assert len(encoded) == 4  # read back from disk, not encoded again
    restarted = cache(tmp_path, 10 * PREPARED_BYTES, encoded)  # a new replica over the same directory
    assert restarted.get(c.id)[0].tokens == 3


def test_a_memory_over_the_whole_budget_still_answers(tmp_path):
    memories = cache(tmp_path, PREPARED_BYTES // 2, [])
    a = memories.create(["a"], ids(["a"]))[0]
    assert list(memories.entries) == [a.id]
    b = memories.create(["b"], ids(["b"]))[0]
    assert list(memories.entries) == [b.id]


def test_ids_that_are_not_hashes_name_no_path(tmp_path):
    memories = cache(tmp_path / "memories", PREPARED_BYTES, [])
    (tmp_path / "secret").mkdir()
    for id in ("../secret", "A" * 64, "0" * 63, ""):
        with pytest.raises(UnknownMemory):
            memories.get(id)
    with pytest.raises(UnknownMemory):
        memories.get("0" * 64)  # well formed, never created


def test_delete_removes_the_cached_and_the_disk_copy(tmp_path):
    memories = cache(tmp_path, 10 * PREPARED_BYTES, [])
    memory = memories.create(["abc"], ids(["abc"]))[0]
    memories.delete(memory.id)
    assert not (tmp_path / memory.id).exists()
    with pytest.raises(UnknownMemory):
        memories.get(memory.id)
    with pytest.raises(UnknownMemory):
        memories.delete(memory.id)


def test_a_store_from_another_encoder_is_refused(tmp_path):
    memory = cache(tmp_path, 10 * PREPARED_BYTES, []).create(["abc"], ids(["abc"]))[0]
    other = dataclasses.replace(IDENTITY, config_sha256="d" * 64)
    reader = MemoryCache(tmp_path, PREPARED_BYTES, other, encode=None, prepare=lambda store: {})
    with pytest.raises(StoreMismatch):
        reader.get(memory.id)


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
    memory, how = rag.create(texts, [t.split() for t in texts])
    assert how == "encoded" and (memory.chunks, memory.tokens, memory.encoder, memory.gca_memory) == (2, 12, None, None)
    assert memory.texts == texts and memory.describe()["encoder"] is None
    assert memory.chunk_ids == [["k1", "=", "1", "2", "3", ";"], ["k2", "=", "4", "5", "6", ";"]]
    assert rag.create(texts, [t.split() for t in texts]) == (memory, "cache") and rag.get(memory.id)[1] == "cache"
    assert tokenized == []  # the ids the app tokenized to check the size: not tokenized again, nor for each question
    in_context = TextMemories(tmp_path, 10_000, "in_context", tokenize=tokenize)
    assert in_context.create(texts, [t.split() for t in texts])[0].id != memory.id
    restarted = TextMemories(tmp_path, 10_000, "rag", tokenize=tokenize)
    reread, how = restarted.get(memory.id)
    assert how == "disk" and reread.texts == memory.texts and reread.chunk_ids == memory.chunk_ids
    assert tokenized == [texts]  # read back from disk: tokenized by this model's tokenizer, once
    with pytest.raises(StoreMismatch, match="made for a rag model; this one reads in_context"):
        in_context.get(memory.id)
    small = TextMemories(tmp_path, 1, "rag", tokenize=tokenize)
    first = small.create(["a b"], ids(["a b"]))[0]
    small.create(["c d"], ids(["c d"]))
    assert list(small.entries) != [first.id] and first.id not in small.entries and small.counts["evicted"] == 1
    small.delete(first.id)
    with pytest.raises(UnknownMemory):
        small.get(first.id)
