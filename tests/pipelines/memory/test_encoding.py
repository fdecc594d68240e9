"""Encoding a repository into a memory store (pipelines/memory/encoding.py), its steps without Ray: every config
problem named at once, before Ray starts; files listed, chunked as the corpus builder chunks them, rejects kept as
rows; each chunk encoded as if alone, whatever it is batched with; the actor's shard and rows. The whole store, its
reading and the job on Ray Data: test_store.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from models.loading import load_encoder
from models.memory import MemoryEncoder
from pipelines.format.tokenizer import cached_tokenizer
from pipelines.memory.encoding import ChunkEncoder, EncodeMemoryConfig, chunk_rows, list_files
from tests.conftest import random_ids


def test_every_problem_is_named_before_any_work(tmp_path):
    problems = EncodeMemoryConfig(encoder_attention="sideways", dtype="float8", chunk_tokens=0, batch_size=-1,
                                  sources=[str(tmp_path / "nope")]).problems()
    assert problems == [
        "model: name the encoder: --model EXPORT_DIR or an encoder checkpoint directory",
        "encoder_attention must be one of ('causal', 'bidirectional'), got 'sideways'",
        f"dtype must be one of {sorted(['bfloat16', 'float16', 'float32'])} or none, got 'float8'",
        "chunk_tokens must be positive", "batch_size must be positive",
        f"source path(s) do not exist: {tmp_path / 'nope'}; pass existing directories, files or git repositories to "
        f"--sources"]
    assert EncodeMemoryConfig(model="x", sources=[str(tmp_path)]).problems() == []


def test_files_are_listed_and_chunked_as_the_corpus_builder_does(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "maths.py").write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n\n" for i in range(30)))
    (repo / "pkg" / "blob.py").write_bytes(b"x = 1\x00\x01")
    (repo / "image.png").write_bytes(b"\x89PNG")  # not a source file: not listed
    items = list_files(EncodeMemoryConfig(sources=[str(repo)]))
    assert items == [{"root": str(repo.resolve()), "path": f"pkg/{name}", "source": "repo", "unit": "repo"}
                     for name in ("blob.py", "maths.py")]
    batch = {key: [item[key] for item in items] for key in items[0]}
    rows = chunk_rows(batch, tokenizer=None, chunk_tokens=64, syntax_cuts=True).to_pylist()
    assert rows[0] == {"path": "pkg/blob.py", "index": -1, "start_line": 0, "end_line": 0, "text": "", "ids": [],
                       "reject": "binary"}
    chunks = rows[1:]
    assert [r["index"] for r in chunks] == list(range(len(chunks))) and len(chunks) > 1
    tokenizer = cached_tokenizer(None)
    assert all(r["ids"] == tokenizer.encode_text(r["text"]) and len(r["ids"]) <= 64 for r in chunks)
    assert chunks[0]["text"].startswith("### pkg/maths.py [chunk 0]\ndef f0(x):")
    with pytest.raises(ValueError, match=r"no source files under .* \(extensions: \['\.c', "):
        list_files(EncodeMemoryConfig(sources=[str(tmp_path / "repo" / "image.png")]))


@pytest.fixture(scope="module")
def chunk_encoder(checkpoint_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    return ChunkEncoder(str(checkpoint_root / "tiny-qwen3-encoder"), "causal", "float32", str(out), use_gpu=False)


@torch.no_grad()
def test_each_chunk_is_encoded_as_if_alone(chunk_encoder, checkpoint_root):
    chunks = [random_ids(5, vocab=496, seed=0).tolist(), random_ids(11, vocab=496, seed=1).tolist()]
    states = chunk_encoder.encode(chunks)
    assert [s.shape for s in states] == [(5, 48), (11, 48)]  # unpadded again
    alone = MemoryEncoder(load_encoder(checkpoint_root / "tiny-qwen3-encoder")).eval()
    for chunk, state in zip(chunks, states, strict=True):
        torch.testing.assert_close(state, alone(torch.tensor([[chunk]]))[0][0], rtol=1e-5, atol=1e-5)
    assert chunk_encoder.encode([]) == []


def test_the_actor_writes_one_shard_and_passes_rejects_through(chunk_encoder):
    batch = {"path": ["a.py", "b.py", "a.py"], "index": [0, -1, 1], "start_line": [1, 0, 9], "end_line": [8, 0, 12],
             "text": ["### a.py [chunk 0]\n", "", "### a.py [chunk 1]\n"], "ids": [[3, 4, 5], [], [6, 7]],
             "reject": ["", "binary", ""]}
    out = chunk_encoder(batch)
    assert out["key"] == ["a.py#0", "", "a.py#1"] and out["tokens"] == [3, 0, 2]
    assert out["reject"] == ["", "binary", ""] and out["shard"][1] == "" and out["shard"][0] == out["shard"][2]
    saved = load_file(f"{chunk_encoder.out}/{out['shard'][0]}")
    assert sorted(saved) == ["a.py#0", "a.py#1", "ids:a.py#0", "ids:a.py#1"] and saved["a.py#1"].shape == (2, 48)
    assert saved["ids:a.py#1"].tolist() == [6, 7]  # the chunk's token ids beside its states (lexical routing)
    rejected_only = chunk_encoder({k: v[1:2] for k, v in batch.items()})
    assert rejected_only["shard"] == [""] and rejected_only["key"] == [""]  # nothing to encode, no shard
