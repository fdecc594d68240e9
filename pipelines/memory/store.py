"""A memory store: a repository's memory chunks encoded once (jobs/encode_memory.py), then read by any model with the
same encoder, so a query pays the decoder only.

    STORE/store.json            the manifest: format version, the encoder's identity, the tokenizer, every chunk
                                (name, path, index, lines, tokens, and the shard and key of its states), the files
                                seen, used and rejected (by reason), the sources
    STORE/chunks.jsonl          one line per chunk, in store order: its name and text (header included)
    STORE/states-*.safetensors  each chunk's encoder states (tokens, H_enc), unpadded, in the store's dtype (the
                                encoder's unless written in another), and its token ids (tokens,) under `ids:KEY`
                                (lexical routing compares them with the question's); an int8 store keeps each
                                chunk's scales beside them (`quantize_int8`)

What is stored is the encoder's output (`AwarenessModel.encode_memory`), taken before the memory projection: it
depends on the encoder alone (its checkpoint, the encoder weights an export trained on top of it, its attention),
never on the decoder, the GCA blocks or the projection, which go on training. So every model built on that encoder
reads the same store, and a model whose encoder differs is refused (`StoreMismatch`, naming both identities and the
fix). Safetensors and JSON only: reading a store never unpickles anything.

A reader gets the chunks' states packed end to end, (1, sum of chunk lengths, H_enc) with an all-true mask: GCA puts
no position on memory keys (models/gca.py), so this is the memory the encoder gives for the same chunks padded to
(1, C * L_max, H_enc), without the padding. A model that routes its memory over chunks (memory_top_k > 0) reads
`memory(chunked=True)` instead: (1, C, L_max, H_enc) and its (1, C, L_max) mask, each chunk's states right-padded to
the longest, which is what routing needs and all it needs: the chunks' boundaries, and each chunk's last real state,
from which every layer's router makes its summary key once per query (not stored: the routers keep training while
the store stays valid). A decoding step then pays C summary scores and k * L_max tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.awareness import CONFIG_NAME, WEIGHTS_NAME, AwarenessConfig

MANIFEST = "store.json"
CHUNKS = "chunks.jsonl"
FORMAT_VERSION = 1
IDS_PREFIX = "ids:"  # a chunk's token ids beside its states in the shard (stores from before them have none)
TOKEN_SCALE_PREFIX = "token_scale:"  # int8 stores: a chunk's per-token scales (tokens,)
CHANNEL_SCALE_PREFIX = "channel_scale:"  # and its per-channel scales (H_enc,)
# How a store keeps its states; a store written before the field existed keeps the encoder's dtype.
STATES_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
INT8_MAX = 127
ENCODER_PREFIX = "memory_encoder."  # the encoder's parameters inside an export's awareness.safetensors
FIX = "re-encode the repository with this model: python jobs/encode_memory.py --model EXPORT --sources REPO --out STORE"


class StoreMismatch(ValueError):
    """The store was encoded by another encoder than the reading model's."""


@dataclass(frozen=True)
class EncoderIdentity:
    """What the stored states depend on. Two identities match when every field but `checkpoint` and `dtype` is
    equal: a moved copy of the same files is the same encoder, and a reader casts the states to its own dtype."""

    checkpoint: str  # the base encoder checkpoint directory
    config_sha256: str  # of its config.json
    weights_sha256: str  # of its *.safetensors files, in name order
    trained_sha256: str | None  # of the encoder weights an export trained on top (LoRA or full); None: frozen
    attention: str  # causal | bidirectional (models.memory.MemoryEncoder)
    hidden_size: int  # H_enc, the states' width
    dtype: str  # the dtype the encoder ran in (informational)

    INFORMATIONAL = ("checkpoint", "dtype")

    def differences(self, other: "EncoderIdentity") -> list[str]:
        return [f.name for f in fields(self) if f.name not in self.INFORMATIONAL
                and getattr(self, f.name) != getattr(other, f.name)]

    def describe(self) -> str:
        trained = f", trained encoder weights {self.trained_sha256[:12]}" if self.trained_sha256 else ""
        return (f"{self.checkpoint} (config {self.config_sha256[:12]}, weights {self.weights_sha256[:12]}{trained}, "
                f"{self.attention}, hidden {self.hidden_size}, {self.dtype})")


# ---------------------------------------------------------------------------------------------- identity
@dataclass(frozen=True)
class EncoderSource:
    """Where a model path's encoder comes from: its base checkpoint, attention, and (for an export) whether the
    export carries trained encoder weights."""

    checkpoint: Path
    attention: str
    export: Path | None = None
    trained: bool = False


def encoder_source(model: str | Path, attention: str = "causal") -> EncoderSource:
    """An export directory (AwarenessModel.save_pretrained: its encoder and attention as it names them) or an
    encoder checkpoint directory (with `attention`)."""
    path = Path(model).expanduser().resolve()
    if not (path / CONFIG_NAME).is_file():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{str(model)!r} is neither an export (no {CONFIG_NAME}) nor an encoder checkpoint "
                                    f"directory (no config.json)")
        return EncoderSource(path, attention)
    config = AwarenessConfig.load(path)
    checkpoint = Path(config.encoder).expanduser()
    checkpoint = checkpoint if checkpoint.is_absolute() else path / checkpoint
    return EncoderSource(checkpoint, config.encoder_attention, path, bool(_trained_encoder_keys(path)))


def encoder_identity(model: str | Path, *, dtype: torch.dtype | str, attention: str = "causal") -> EncoderIdentity:
    """The identity of the encoder a model path reads its memory with (see `encoder_source`). Hashes the encoder's
    files once per process (cached by their sizes and modification times)."""
    source = encoder_source(model, attention)
    config_sha, weights_sha = checkpoint_digests(source.checkpoint)
    hidden = json.loads((source.checkpoint / "config.json").read_text())["hidden_size"]
    trained = _trained_digest(source.export) if source.trained else None
    return EncoderIdentity(str(source.checkpoint), config_sha, weights_sha, trained, source.attention, int(hidden),
                           str(dtype).removeprefix("torch."))


def checkpoint_digests(directory: Path) -> tuple[str, str]:
    """sha256 of config.json and of the *.safetensors files (name and bytes, in name order)."""
    files = [directory / "config.json", *sorted(directory.glob("*.safetensors"))]
    if not files[0].is_file() or len(files) == 1:
        raise FileNotFoundError(f"encoder checkpoint {str(directory)!r} needs config.json and *.safetensors to be "
                                f"identified (a memory store names the exact encoder that made it)")
    stamps = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _digests(stamps)


@functools.lru_cache(maxsize=16)
def _digests(stamps: tuple[tuple[str, int, int], ...]) -> tuple[str, str]:
    config = hashlib.sha256(Path(stamps[0][0]).read_bytes()).hexdigest()
    weights = hashlib.sha256()
    for name, _, _ in stamps[1:]:
        weights.update(Path(name).name.encode() + b"\0")
        with open(name, "rb") as f:
            while block := f.read(1 << 24):
                weights.update(block)
    return config, weights.hexdigest()


def _trained_encoder_keys(export: Path) -> list[str]:
    path = export / WEIGHTS_NAME
    if not path.is_file():
        return []
    with safe_open(str(path), framework="pt") as f:
        return sorted(k for k in f.keys() if k.startswith(ENCODER_PREFIX))


def _trained_digest(export: Path) -> str:
    digest = hashlib.sha256()
    with safe_open(str(export / WEIGHTS_NAME), framework="pt") as f:
        for key in _trained_encoder_keys(export):
            tensor = f.get_tensor(key).contiguous()
            digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}\0".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- int8 states
def quantize_int8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's states (tokens, H_enc) as int8 with a per-token and a per-channel scale: a decoder's hidden states
    have a few channels and a few tokens (an attention sink's) far larger than the rest, and one scale for either
    would spend the int8 range on them. The two scales balance each other's root mean square (two alternations),
    then each token takes its largest scaled magnitude to 127. Returns (int8 (tokens, H_enc), per-token scales
    (tokens,), per-channel scales (H_enc,)) in fp32; `dequantize_int8` inverts it, each element within half a step
    (token_scale * channel_scale / 2) of the original."""
    x = states.detach().float()
    tiny = 1e-30  # an all-zero token or channel: scale 1e-30, not a division by zero
    token = torch.ones(x.shape[0])
    for _ in range(2):
        channel = (x / token[:, None]).pow(2).mean(dim=0).sqrt().clamp_min(tiny)
        token = (x / channel).pow(2).mean(dim=1).sqrt().clamp_min(tiny)
    scaled = x / token[:, None] / channel
    top = scaled.abs().amax(dim=1) / INT8_MAX
    token = token * torch.where(top > 0, top, 1.0)
    q = torch.round(x / token[:, None] / channel).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, token, channel


def dequantize_int8(q: torch.Tensor, token_scale: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
    """fp32 states from `quantize_int8`'s three tensors."""
    return q.float() * token_scale[:, None] * channel_scale[None, :]


def stored_and_read(state: torch.Tensor, states_dtype: str) -> torch.Tensor:
    """A chunk's states (tokens, H_enc) as a store in `states_dtype` gives them back to its reader
    (MemoryStore.states), in the states' own dtype and device: what reading from such a store changes, no store
    written."""
    if states_dtype == "int8":
        back = dequantize_int8(*quantize_int8(state.detach().cpu()))
    else:
        back = state.detach().to(STATES_DTYPES[states_dtype])
    return back.to(device=state.device, dtype=state.dtype)


def read_memory_as_stored(encoder: torch.nn.Module, states_dtype: str, chunk_len: int):
    """Makes a MemoryEncoder (states (B, C * chunk_len, H_enc) and mask) return each chunk's real tokens as a store
    in `states_dtype` would give them back, so a whole evaluation reads what a store would hold; the hook's handle
    (`.remove()` undoes it)."""
    if states_dtype not in STATES_DTYPES:
        raise ValueError(f"states_dtype must be one of {sorted(STATES_DTYPES)}, got {states_dtype!r}")

    def as_stored(module, args, output):
        states, mask = output
        b, m, h = states.shape
        chunks, masks = states.reshape(-1, chunk_len, h), mask.reshape(-1, chunk_len).bool()
        back = chunks.clone()
        for i, (chunk, real) in enumerate(zip(chunks, masks)):
            if real.any():
                back[i, real] = stored_and_read(chunk[real], states_dtype)
        return back.reshape(b, m, h), mask

    return encoder.register_forward_hook(as_stored)


# ---------------------------------------------------------------------------------------------- writing
def chunk_entry(*, path: str, index: int, start_line: int = 0, end_line: int = 0, tokens: int, shard: str,
                key: str) -> dict[str, Any]:
    """One chunk of the manifest; `name` is its header line, what a `<read>` names (chunking.chunk_name)."""
    return {"name": f"### {path} [chunk {index}]", "path": path, "index": int(index), "start_line": int(start_line),
            "end_line": int(end_line), "tokens": int(tokens), "shard": shard, "key": key}


def write_shard(directory: str | Path, states: dict[str, torch.Tensor], ids: dict[str, list[int]],
                states_dtype: str | None = None) -> str:
    """Chunk states {key: (tokens, H_enc)} and token ids {key: ids} as one safetensors file under `directory` (a Ray
    actor's batch, or a whole small store), the states in `states_dtype` (STATES_DTYPES; None: as given); returns
    its name. Names are unique, so actors write side by side."""
    tensors = {}
    for key, state in states.items():
        state = state.detach().cpu()
        if states_dtype == "int8":
            state, tensors[TOKEN_SCALE_PREFIX + key], tensors[CHANNEL_SCALE_PREFIX + key] = quantize_int8(state)
        elif states_dtype is not None:
            state = state.to(STATES_DTYPES[states_dtype])
        tensors[key] = state.contiguous()
    for key, chunk in ids.items():
        if len(chunk) != len(tensors[key]):
            raise ValueError(f"chunk {key}: {len(chunk)} token ids for {len(tensors[key])} states")
        tensors[IDS_PREFIX + key] = torch.tensor(list(chunk), dtype=torch.int64)
    name = f"states-{uuid.uuid4().hex[:12]}.safetensors"
    save_file(tensors, str(Path(directory) / name))
    return name


def clear(directory: str | Path) -> Path:
    """An empty store directory: a rewrite replaces, never mixes with, an older store."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for old in [*directory.glob("states-*.safetensors"), directory / MANIFEST, directory / CHUNKS]:
        old.unlink(missing_ok=True)
    return directory


def write_manifest(directory: str | Path, chunks: list[dict[str, Any]], texts: list[str], identity: EncoderIdentity,
                   states_dtype: str | None = None, **about: Any) -> dict[str, Any]:
    """store.json and chunks.jsonl for chunks in store order (their shards already written in `states_dtype`: None,
    the encoder's); `about` adds the tokenizer, the sources, the files seen and rejected, ... Returns the manifest."""
    directory = Path(directory)
    with open(directory / CHUNKS, "w") as f:
        for entry, text in zip(chunks, texts, strict=True):
            f.write(json.dumps({"name": entry["name"], "text": text}) + "\n")
    manifest = {"format_version": FORMAT_VERSION, "encoder": asdict(identity),
                "states_dtype": states_dtype or identity.dtype, "chunks": chunks,
                "tokens": sum(c["tokens"] for c in chunks), **about}
    partial = directory / f"{MANIFEST}.{os.getpid()}.tmp"  # the manifest appears last and whole: a store is complete
    partial.write_text(json.dumps(manifest, indent=1))
    partial.replace(directory / MANIFEST)
    return manifest


def write(directory: str | Path, chunks: Iterable[tuple[str, int, str]], states: Iterable[torch.Tensor],
          ids: Iterable[list[int]], identity: EncoderIdentity, states_dtype: str | None = None,
          **about: Any) -> dict[str, Any]:
    """A whole store in this process: chunks as (path, index, text), each one's states (tokens, H_enc) as
    `encode_memory` returns them for that chunk alone, unpadded, and its token ids; the states kept in
    `states_dtype` (None: as given). For stores too large for one process, see pipelines.memory.encoding (Ray
    Data)."""
    directory = clear(directory)
    entries, texts, tensors, token_ids = [], [], {}, {}
    for (path, index, text), state, chunk_ids in zip(chunks, states, ids, strict=True):
        key = f"{len(entries)}"
        tensors[key], token_ids[key] = state, list(chunk_ids)
        entries.append(chunk_entry(path=path, index=index, tokens=state.shape[0], shard="", key=key))
        texts.append(text)
    shard = write_shard(directory, tensors, token_ids, states_dtype)
    for entry in entries:
        entry["shard"] = shard
    return write_manifest(directory, entries, texts, identity, states_dtype, **about)


# ---------------------------------------------------------------------------------------------- reading
class MemoryStore:
    """An opened store: its manifest, its chunks' names and texts, and their states as a model's memory."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).expanduser()
        path = self.directory / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{str(self.directory)!r} is not a memory store (no {MANIFEST}): make one with "
                                    f"python jobs/encode_memory.py --model EXPORT --sources REPO --out STORE")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: store format {self.manifest.get('format_version')}, this code reads "
                             f"{FORMAT_VERSION}; {FIX}")
        self.identity = EncoderIdentity(**self.manifest["encoder"])
        self.states_dtype = self.manifest.get("states_dtype", self.identity.dtype)
        if self.states_dtype not in STATES_DTYPES:
            raise ValueError(f"{path}: states in {self.states_dtype!r}, this code reads {sorted(STATES_DTYPES)}; {FIX}")

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return self.manifest["chunks"]

    def names(self) -> list[str]:
        return [c["name"] for c in self.chunks]

    def texts(self) -> list[str]:
        with open(self.directory / CHUNKS) as f:
            return [json.loads(line)["text"] for line in f]

    def check(self, identity: EncoderIdentity) -> None:
        """Refuses a reader whose encoder is not the one that made the store, naming both and the fix."""
        different = self.identity.differences(identity)
        if different:
            raise StoreMismatch(
                f"memory store {str(self.directory)!r} was encoded by another encoder ({', '.join(different)} differ): "
                f"the store's encoder is {self.identity.describe()}; this model's is {identity.describe()}. States "
                f"from another encoder mean nothing to this model's GCA: {FIX}")

    def states(self) -> list[torch.Tensor]:
        """Each chunk's states (tokens, H_enc), in store order: as stored, or fp32 from an int8 store."""
        if self.states_dtype != "int8":
            return self._tensors("")
        return [dequantize_int8(q, token, channel) for q, token, channel in
                zip(self._tensors(""), self._tensors(TOKEN_SCALE_PREFIX), self._tensors(CHANNEL_SCALE_PREFIX))]

    def states_bytes(self) -> int:
        """What the stored states take on disk and in memory as stored: values and scales, not token ids."""
        total = 0
        for prefix in ("", TOKEN_SCALE_PREFIX, CHANNEL_SCALE_PREFIX) if self.states_dtype == "int8" else ("",):
            total += sum(t.numel() * t.element_size() for t in self._tensors(prefix))
        return total

    def token_ids(self, *, device: str | torch.device = "cpu") -> torch.Tensor:
        """The chunks' token ids (1, C, L_max), right-padded with 0 as `memory(chunked=True)` pads the states (its
        mask says which are real): what lexical routing compares the question with."""
        ids = self._tensors(IDS_PREFIX)
        return torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)[None].to(device)

    def _tensors(self, prefix: str) -> list[torch.Tensor]:
        """Each chunk's tensor stored under `prefix + key`, in store order, each shard opened once."""
        by_shard: dict[str, list[int]] = {}
        for i, chunk in enumerate(self.chunks):
            by_shard.setdefault(chunk["shard"], []).append(i)
        out: list[torch.Tensor | None] = [None] * len(self.chunks)
        for shard, positions in by_shard.items():
            with safe_open(str(self.directory / shard), framework="pt") as f:
                stored = set(f.keys())
                for i in positions:
                    key = prefix + self.chunks[i]["key"]
                    if key not in stored:
                        raise ValueError(f"memory store {str(self.directory)!r} keeps no {key!r} (token ids were not "
                                         f"stored before lexical routing read them): {FIX}")
                    out[i] = f.get_tensor(key)
        return out  # type: ignore[return-value]

    def memory(self, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, chunked: bool = False):
        """memory_states (1, M, H_enc) and memory_states_mask (1, M): every chunk's states end to end; `chunked`:
        (1, C, L_max, H_enc) and (1, C, L_max), each chunk right-padded to the longest (chunk routing)."""
        if not self.chunks:
            raise ValueError(f"memory store {str(self.directory)!r} holds no chunks")
        if chunked:
            chunks = self.states()
            lengths = torch.tensor([len(c) for c in chunks], device=device)
            states = torch.nn.utils.rnn.pad_sequence(chunks, batch_first=True)[None].to(device=device, dtype=dtype)
            mask = torch.arange(states.shape[2], device=device) < lengths[:, None]  # (C, L_max)
            return states, mask[None]
        states = torch.cat(self.states())[None].to(device=device, dtype=dtype)  # (1, sum L_i, H_enc)
        return states, torch.ones(states.shape[:2], dtype=torch.bool, device=device)


def read(directory: str | Path, identity: EncoderIdentity, *, device: str | torch.device = "cpu",
         dtype: torch.dtype | None = None, chunked: bool = False):
    """The store's memory (`MemoryStore.memory`) for a model whose encoder has `identity`; StoreMismatch otherwise."""
    store = MemoryStore(directory)
    store.check(identity)
    return store.memory(device=device, dtype=dtype, chunked=chunked)
