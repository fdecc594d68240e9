"""The memory store: a repository's chunks encoded once, then read back as the model's memory. Stored states give the
logits and answers of encoding the same chunks on the fly; a store made by another encoder is refused; files that
cannot be used are counted; jobs/encode_memory.py builds the same store on Ray Data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from models import PAIRS, AwarenessModel, MemoryReading, build_pair, write_random_checkpoints
from pipelines.evaluate.needle import NeedleSuite
from pipelines.memory import store as memory_store
from pipelines.memory.encoding import ChunkEncoder, EncodeMemoryConfig, chunk_rows, finish, list_files
from pipelines.memory.store import MemoryStore, StoreMismatch, encoder_identity
from tests.conftest import open_gates

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def pair_root(tmp_path_factory) -> Path:
    """tiny-text: the tiny shapes with Qwen3's vocabulary, so a repository's chunks are ids the encoder knows."""
    root = tmp_path_factory.mktemp("text-pair")
    write_random_checkpoints(PAIRS["tiny-text"], root)
    return root


@pytest.fixture(scope="module")
def export(pair_root, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = open_gates(build_pair("tiny-text", checkpoint_root=pair_root, gca_layers="upper_half"))
    return model.save_pretrained(tmp_path_factory.mktemp("export") / "export")


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A small repository: code and a document, one file too long for one chunk, and two files no reader can use."""
    root = tmp_path_factory.mktemp("repo")
    (root / "pkg").mkdir()
    (root / "pkg" / "maths.py").write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n\n" for i in range(40)))
    (root / "pkg" / "names.py").write_text("class Greeter:\n    def hello(self, name):\n        return 'hi ' + name\n")
    (root / "README.md").write_text("# Demo\n\nThe answer is forty-two.\n")
    (root / "pkg" / "blob.py").write_bytes(b"x = 1\n\x00\x01\x02 binary\n")
    (root / "pkg" / "latin1.py").write_bytes("s = 'caf\u00e9'\n".encode("latin-1"))
    return root


def config_for(export: Path, repo: Path, out: Path, **overrides) -> EncodeMemoryConfig:
    return EncodeMemoryConfig(model=str(export), sources=[str(repo)], out=str(out), chunk_tokens=64, batch_size=4,
                              **overrides)


def encode_here(config: EncodeMemoryConfig) -> dict:
    """The job's steps without Ray: list, chunk, encode (one actor's work, in batches), write the manifest."""
    items = list_files(config)
    batch = {k: [item[k] for item in items] for k in items[0]}
    rows = chunk_rows(batch, tokenizer=None, chunk_tokens=config.chunk_tokens, syntax_cuts=True).to_pydict()
    out = memory_store.clear(config.out)
    encoder = ChunkEncoder(config.model, config.encoder_attention, "float32", str(out), use_gpu=False,
                           store_dtype=config.store_dtype)
    encoded: list[dict] = []
    for start in range(0, len(rows["path"]), config.batch_size):
        part = encoder({k: v[start : start + config.batch_size] for k, v in rows.items()})
        encoded += [dict(zip(part, values)) for values in zip(*part.values())]
    identity = encoder_identity(config.model, dtype=torch.float32)
    return finish(config, out, encoded, identity, None, len(items), 0.0)


@pytest.fixture(scope="module")
def store(export, repo, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("store") / "store"
    encode_here(config_for(export, repo, out))
    return out


def padded(model: AwarenessModel, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk texts as the pyfunc gives them to the encoder: (1, C, longest chunk), right-padded."""
    from pipelines.format.tokenizer import cached_tokenizer

    chunks = [cached_tokenizer(None).encode_text(text) for text in texts]
    ids = torch.zeros((1, len(chunks), max(map(len, chunks))), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, chunk in enumerate(chunks):
        ids[0, i, : len(chunk)], mask[0, i, : len(chunk)] = torch.tensor(chunk), 1
    return ids, mask


def test_the_store_holds_every_chunk_with_its_header_and_counts_rejected_files(store, repo):
    opened = MemoryStore(store)
    manifest = opened.manifest
    assert manifest["files"] == {"seen": 5, "rejected": 2}
    assert manifest["rejects"] == {"binary": 1, "non_utf8": 1}
    assert manifest["rejected_files"] == ["pkg/blob.py", "pkg/latin1.py"]
    paths = {c["path"] for c in opened.chunks}
    assert paths == {"README.md", "pkg/maths.py", "pkg/names.py"}
    maths = [c for c in opened.chunks if c["path"] == "pkg/maths.py"]
    assert len(maths) > 1 and [c["index"] for c in maths] == list(range(len(maths)))  # cut, in file order
    texts = opened.texts()
    for chunk, text, states in zip(opened.chunks, texts, opened.states(), strict=True):
        assert text.startswith(chunk["name"] + "\n")  # `### path [chunk k]`: the header a <read> names
        assert states.shape == (chunk["tokens"], PAIRS["tiny-text"].encoder_config["hidden_size"])
    assert manifest["tokens"] == sum(c["tokens"] for c in opened.chunks)
    assert manifest["encoder"]["checkpoint"].endswith(PAIRS["tiny-text"].encoder)
    assert manifest["encoder"]["trained_sha256"] is None and manifest["encoder"]["attention"] == "causal"
    assert not list(store.glob("*.pt")) and not list(store.glob("*.pkl"))  # safetensors and JSON only


def test_stored_states_give_the_logits_of_encoding_the_chunks_on_the_fly(store, export):
    model = AwarenessModel.from_pretrained(export).eval()
    opened = MemoryStore(store)
    states, mask = memory_store.read(store, encoder_identity(export, dtype=torch.float32))
    ids, chunk_mask = padded(model, opened.texts())
    prompt = torch.tensor([[11, 2001, 30, 4099, 12]])
    with torch.no_grad():
        stored = model(input_ids=prompt, memory_states=states, memory_states_mask=mask).logits
        fresh = model(input_ids=prompt, memory_input_ids=ids, memory_attention_mask=chunk_mask).logits
        alone = model(input_ids=prompt).logits
    torch.testing.assert_close(stored, fresh)
    assert (stored - alone).abs().max() > 1e-3  # the gates are open: the memory changes the logits
    with torch.no_grad():
        on_the_fly, _ = model.encode_memory(ids, chunk_mask)  # (1, C*L, H_enc), padding zeroed
    assert states.shape[1] == int(chunk_mask.sum()) < on_the_fly.shape[1]  # the store keeps no padding


@pytest.mark.parametrize("lexical", [0.0, 1.0])
def test_a_routing_model_reads_the_store_chunked_with_the_logits_of_encoding_on_the_fly(store, export, pair_root,
                                                                                     tmp_path, lexical):
    """memory_top_k 2 of the store's chunks: read chunked (each chunk padded to the longest), the stored states route
    and read as the chunk texts encoded on the fly do; the pyfunc answers alike from both. With lexical routing the
    store's token ids (those the encoder read) give the question's prior as the chunk ids do."""
    from pipelines.serving.pyfunc import AwarenessPyfunc, ensure_tokenizer

    torch.manual_seed(0)
    model = open_gates(build_pair("tiny-text", checkpoint_root=pair_root, gca_layers="upper_half",
                                  reading=MemoryReading(top_k=2, lexical_routing=lexical)))
    routed_export = model.save_pretrained(tmp_path / "routed")  # the same encoder as the store's: it reads it
    ensure_tokenizer(model.config.decoder)  # the served model's tokenizer.json
    model.eval()
    opened = MemoryStore(store)
    states, mask = memory_store.read(store, encoder_identity(routed_export, dtype=torch.float32), chunked=True)
    lengths = [c["tokens"] for c in opened.chunks]
    assert states.shape[:3] == (1, len(lengths), max(lengths)) and mask.sum(-1).tolist() == [lengths]
    assert len(lengths) > model.reading.top_k  # routing selects
    ids, chunk_mask = padded(model, opened.texts())
    token_ids = opened.token_ids()
    assert torch.equal(token_ids * mask, ids * chunk_mask)  # the ids the encoder read, padded as the states are
    prompt = torch.cat([torch.tensor([[11]]), ids[:, 3, 2:6]], dim=1)  # names chunk 3's tokens
    chunk_ids = {"memory_chunk_ids": token_ids} if lexical else {}
    with torch.no_grad():
        stored = model(input_ids=prompt, memory_states=states, memory_states_mask=mask, **chunk_ids).logits
        fresh = model(input_ids=prompt, memory_input_ids=ids, memory_attention_mask=chunk_mask).logits
        model.reading = replace(model.reading, top_k=len(lengths))
        every_chunk = model(input_ids=prompt, memory_states=states, memory_states_mask=mask, **chunk_ids).logits
    torch.testing.assert_close(stored, fresh)
    assert (stored - every_chunk).abs().max() > 1e-4  # two chunks of the store read otherwise than all of them
    pyfunc = AwarenessPyfunc()
    pyfunc.load_context(SimpleNamespace(artifacts={"export": str(routed_export)}, model_config={"max_new_tokens": 4}))
    question = "Which function returns x * 7?"
    assert (pyfunc.predict(None, [{"question": question, "memory_store": str(store)}])
            == pyfunc.predict(None, [{"question": question, "memory": opened.texts()}]))


def test_int8_states_are_within_half_a_step_of_each_element_and_keep_outlier_channels_and_tokens():
    """quantize_int8 against a hand-computed bound: every element within token_scale * channel_scale / 2 of the
    original; a channel 100x the others and a token 50x the others do not take the rest's resolution."""
    torch.manual_seed(0)
    states = torch.randn(37, 64)
    states[:, 5] *= 100.0  # an outlier channel
    states[0] *= 50.0  # an outlier token (an attention sink's)
    q, token, channel = memory_store.quantize_int8(states)
    assert q.dtype == torch.int8 and q.shape == states.shape and token.shape == (37,) and channel.shape == (64,)
    assert q.abs().max() <= memory_store.INT8_MAX
    back = memory_store.dequantize_int8(q, token, channel)
    step = token[:, None] * channel[None, :]
    assert ((back - states).abs() <= step / 2 + 1e-6 * states.abs()).all()
    ordinary = states[1:, torch.arange(64) != 5]
    error = (back[1:, torch.arange(64) != 5] - ordinary).norm() / ordinary.norm()
    assert error < 0.015  # int8's rounding of a Gaussian at full range is ~0.7%; per-token absmax alone gives ~26%
    zeros = memory_store.dequantize_int8(*memory_store.quantize_int8(torch.zeros(3, 4)))
    assert torch.equal(zeros, torch.zeros(3, 4))  # no division by zero


@pytest.mark.parametrize("states_dtype", ["bfloat16", "int8"])
def test_a_store_in_fewer_bits_reads_back_close_to_fp32_in_its_bytes(store, export, repo, tmp_path, states_dtype):
    """jobs/encode_memory.py --store_dtype: the same chunks stored in bf16 or int8 take half or a quarter of fp32's
    bytes (int8's scales included), read back as the model's memory within their rounding, and give its logits."""
    out = tmp_path / states_dtype
    manifest = encode_here(config_for(export, repo, out, store_dtype=states_dtype))
    full, small = MemoryStore(store), MemoryStore(out)
    assert manifest["states_dtype"] == states_dtype == small.states_dtype and full.states_dtype == "float32"
    assert small.names() == full.names()
    ratio = small.states_bytes() / full.states_bytes()
    assert (0.5 if states_dtype == "bfloat16" else 0.25) <= ratio <= (0.5 if states_dtype == "bfloat16" else 0.3)
    for exact, rounded in zip(full.states(), small.states(), strict=True):
        assert rounded.shape == exact.shape
        assert ((rounded.float() - exact).norm() / exact.norm()) < 0.01
    model = AwarenessModel.from_pretrained(export).eval()
    identity = encoder_identity(export, dtype=torch.float32)
    prompt = torch.tensor([[11, 2001, 30, 4099, 12]])
    with torch.no_grad():
        exact = model(input_ids=prompt, memory_states=memory_store.read(store, identity)[0]).logits
        rounded = model(input_ids=prompt, memory_states=memory_store.read(out, identity, dtype=torch.float32)[0]).logits
        alone = model(input_ids=prompt).logits
    assert (rounded - exact).abs().max() < 0.05 * (exact - alone).abs().max()


def test_an_unknown_store_dtype_is_refused_before_anything_is_encoded(export, repo, tmp_path):
    problems = config_for(export, repo, tmp_path / "out", store_dtype="int4").problems()
    assert problems == ["store_dtype must be one of ['bfloat16', 'float16', 'float32', 'int8'] or none, got 'int4'"]


def test_a_store_from_another_encoder_is_refused(store, export, pair_root, tmp_path):
    spec = PAIRS["tiny-text"]
    _, other_encoder = write_random_checkpoints(spec, tmp_path / "other", seed=7)  # same shapes, other weights
    torch.manual_seed(0)
    other = AwarenessModel.from_pretrained_pair(pair_root / spec.decoder, other_encoder, gca_layers="upper_half")
    other_export = other.save_pretrained(tmp_path / "other-export")
    with pytest.raises(StoreMismatch) as refused:
        memory_store.read(store, encoder_identity(other_export, dtype=torch.float32))
    message = str(refused.value)
    assert "weights_sha256" in message and "config_sha256" not in message.split("differ")[0]
    assert str(pair_root / spec.encoder) in message and str(other_encoder) in message  # both identities
    assert "jobs/encode_memory.py" in message  # and the fix
    bidirectional = encoder_identity(pair_root / spec.encoder, dtype=torch.float32, attention="bidirectional")
    with pytest.raises(StoreMismatch, match="attention"):
        MemoryStore(store).check(bidirectional)
    # the same encoder files, named directly rather than through an export, and in another dtype: the same encoder
    MemoryStore(store).check(encoder_identity(pair_root / spec.encoder, dtype=torch.bfloat16))


def test_the_pyfunc_answers_from_a_store_as_from_the_chunk_texts(store, export):
    from pipelines.serving.pyfunc import AwarenessPyfunc, ensure_tokenizer

    ensure_tokenizer(AwarenessModel.from_pretrained(export).config.decoder)  # the served model's tokenizer.json
    texts = MemoryStore(store).texts()
    questions = ["Which function returns x * 7?", "What is the answer?"]
    pyfunc = AwarenessPyfunc()
    pyfunc.load_context(SimpleNamespace(artifacts={"export": str(export)}, model_config={"max_new_tokens": 6}))
    from_texts = pyfunc.predict(None, [{"question": q, "memory": texts} for q in questions])
    from_store = pyfunc.predict(None, [{"question": q, "memory_store": str(store)} for q in questions])
    without = pyfunc.predict(None, [{"question": q} for q in questions])
    assert from_store == from_texts and from_store != without
    configured = AwarenessPyfunc()
    configured.load_context(SimpleNamespace(artifacts={"export": str(export)},
                                            model_config={"max_new_tokens": 6, "memory_store": str(store)}))
    assert configured.predict(None, [{"question": q} for q in questions]) == from_texts
    with pytest.raises(ValueError, match="not both"):
        pyfunc.predict(None, [{"question": questions[0], "memory": texts, "memory_store": str(store)}])


def test_the_efficiency_suite_reads_gca_memory_from_a_store(export, monkeypatch):
    """gca's time to first token is timed over a store written to disk and read back, checked against its encoder."""
    from pipelines.data.memory_modes import MemoryMode
    from pipelines.data.synthetic_needles import NeedleSpec
    from pipelines.evaluate.common import System
    from pipelines.evaluate.efficiency import efficiency_row

    model = AwarenessModel.from_pretrained(export).eval()
    reads = []
    original = memory_store.read
    monkeypatch.setattr(memory_store, "read", lambda *a, **k: reads.append(a) or original(*a, **k))
    row = efficiency_row(System("gca", model, MemoryMode(), NeedleSpec(), export=str(export)), 256,
                                decode_tokens=2, repeats=2)
    assert row["ttft_s"] > 0 and row["encode_s"] > 0
    assert len(reads) == 1 + 2 + 1  # the warm-up and each timed first token read the store; generate reads it once
    with pytest.raises(ValueError, match="export"):
        efficiency_row(System("gca", model, MemoryMode(), NeedleSpec()), 256, decode_tokens=2)


def test_the_job_refuses_a_model_that_is_no_export_nor_encoder_before_starting_ray(repo, tmp_path, capsys):
    import jobs.encode_memory

    with pytest.raises(SystemExit) as exit:
        jobs.encode_memory.main(["--model", str(tmp_path), "--sources", str(repo), "--out", str(tmp_path / "s")])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and "neither an export" in err
    assert json.loads(out.strip().splitlines()[-1])["job"] == "encode_memory"


@pytest.mark.ray
@pytest.mark.slow
def test_the_job_builds_the_same_store_on_ray_data(store, export, repo, tmp_path):
    """As a user runs it, as a process: the last line is the JSON summary, and the store equals the one built
    without Ray."""
    out = tmp_path / "store"
    command = [sys.executable, str(ROOT / "jobs" / "encode_memory.py"), "--model", str(export), "--sources", str(repo),
               "--out", str(out), "--chunk_tokens", "64", "--batch_size", "3", "--actors", "2", "--num_cpus", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    here = MemoryStore(store)
    assert summary == {"job": "encode_memory", "store": str(out), "chunks": len(here.chunks),
                       "tokens": here.manifest["tokens"], "files": {"seen": 5, "rejected": 2},
                       "rejects": {"binary": 1, "non_utf8": 1}, "encoder": here.identity.checkpoint,
                       "seconds": summary["seconds"]}
    built = MemoryStore(out)
    assert built.names() == here.names() and built.texts() == here.texts()
    assert len({c["shard"] for c in built.chunks}) > 1  # several batches, each its actor's shard
    assert built.identity == here.identity
    for a, b in zip(built.states(), here.states(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_store_without_token_ids_is_refused_by_lexical_routing_with_the_fix(store, tmp_path):
    """A store written before shards held token ids: its states read as before, its ids are refused naming the fix."""
    import shutil

    from safetensors.torch import load_file, save_file

    old = tmp_path / "old-store"
    shutil.copytree(store, old)
    for shard in old.glob("states-*.safetensors"):
        save_file({k: v for k, v in load_file(str(shard)).items() if not k.startswith("ids:")}, str(shard))
    opened = MemoryStore(old)
    assert [s.shape for s in opened.states()] == [s.shape for s in MemoryStore(store).states()]
    with pytest.raises(ValueError, match="encode_memory.py"):
        opened.token_ids()


def test_reading_a_memory_as_stored_rounds_each_chunks_real_tokens_as_the_store_does(export):
    """pipelines.memory.store.read_memory_as_stored (the needle suite's needle.store_dtype): the encoder's states of
    each chunk's real tokens come back as write_shard stores them and MemoryStore.states reads them; padding and a
    float32 store change nothing, and removing the hook restores the encoder."""
    model = AwarenessModel.from_pretrained(export).eval()
    chunk_len = 8
    ids = torch.randint(0, 1000, (2, 3, chunk_len), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 2, 5:] = 0
    with torch.no_grad():
        states, _ = model.memory_encoder(ids, mask)
        handle = memory_store.read_memory_as_stored(model.memory_encoder, "int8", chunk_len)
        stored, _ = model.memory_encoder(ids, mask)
        handle.remove()
        handle = memory_store.read_memory_as_stored(model.memory_encoder, "float32", chunk_len)
        as_fp32, _ = model.memory_encoder(ids, mask)
        handle.remove()
        again, _ = model.memory_encoder(ids, mask)
    for b in range(2):
        for c in range(3):
            span, real = slice(c * chunk_len, (c + 1) * chunk_len), mask[b, c].bool()
            want = memory_store.dequantize_int8(*memory_store.quantize_int8(states[b, span][real]))
            assert torch.equal(stored[b, span][real], want)
            assert torch.equal(stored[b, span][~real], states[b, span][~real])
    assert not torch.equal(stored, states) and torch.equal(as_fp32, states) and torch.equal(again, states)
    assert "needle.store_dtype 'int4'" in " ".join(NeedleSuite(store_dtype="int4").problems())
