"""Encoding a repository into a memory store on Ray Data (jobs/encode_memory.py).

The driver lists the repository's files (names only, as the corpus builder does); Ray Data tasks read and chunk them
with the corpus builder's chunker (`tasks.chunk_records`: the same headers, cuts and rejects), and `map_batches` on an
actor pool whose actors each hold the encoder turns batches of chunks into states, each batch written by its actor as
one safetensors shard. Only chunk metadata and texts come back to the driver, which writes the manifest
(pipelines.memory.store). A file that cannot be used (binary, not UTF-8, empty, too large, a symlink leaving
the repository) is counted by reason in the manifest, never dropped silently.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch

from models.awareness import AwarenessConfig, AwarenessModel
from models.loading import load_encoder
from models.memory import ENCODER_ATTENTIONS, MemoryEncoder
from pipelines.corpora import sources, tasks
from pipelines.data.batch_inference import DTYPES, actor_dtype, items_dataset, map_with_actors
from pipelines.format.tokenizer import cached_tokenizer
from pipelines.memory import store as memory_store


@dataclass
class EncodeMemoryConfig:
    model: str = ""  # an export directory (AwarenessModel.save_pretrained) or an encoder checkpoint directory
    sources: list[str] = field(default_factory=list)  # the repository: directories or files, chunked together
    out: str = "outputs/memory_store"  # the store directory (replaced if it holds a store)
    encoder_attention: str = "causal"  # an encoder checkpoint's attention (an export names its own)
    tokenizer: str | None = None  # a directory with tokenizer.json; None: the export's decoder's or the encoder's, else the offline Qwen3 one
    chunk_tokens: int = 512  # memory chunk size (tokens, header included), as the corpus builder's
    syntax_cuts: bool = True  # cut code at tree-sitter nodes (False: at paragraph breaks, no parse)
    batch_size: int = 16  # chunks per encoder call (one safetensors shard each)
    actors: int = 1  # Ray Data actors holding the encoder
    cpus_per_actor: float = 1.0  # CPUs Ray reserves for each encoding actor
    use_gpu: bool = False  # one GPU per actor
    dtype: str | None = None  # float32 | bfloat16 | float16; None: bfloat16 on GPU, float32 on CPU
    # how the store keeps the states: float32 | bfloat16 | float16 | int8 (per-token and per-channel scales, a
    # quarter of fp32's bytes); None: the encoder's dtype
    store_dtype: str | None = None
    num_cpus: int | None = None  # local Ray only: CPUs to use; None: join $RAY_ADDRESS or a running cluster, else all

    def problems(self) -> list[str]:
        p = [] if self.model else ["model: name the encoder: --model EXPORT_DIR or an encoder checkpoint directory"]
        if self.encoder_attention not in ENCODER_ATTENTIONS:
            p.append(f"encoder_attention must be one of {ENCODER_ATTENTIONS}, got {self.encoder_attention!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            p.append(f"dtype must be one of {sorted(DTYPES)} or none, got {self.dtype!r}")
        if self.store_dtype is not None and self.store_dtype not in memory_store.STATES_DTYPES:
            p.append(f"store_dtype must be one of {sorted(memory_store.STATES_DTYPES)} or none, "
                     f"got {self.store_dtype!r}")
        p += [f"{name} must be positive" for name in ("chunk_tokens", "batch_size", "actors")
              if getattr(self, name) <= 0]
        try:
            sources.check_sources(self.sources)  # a missing path fails here, before Ray starts
        except (FileNotFoundError, ValueError) as error:
            p.append(str(error))
        return p

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[actor_dtype(self.dtype, self.use_gpu)]


def tokenizer_dir(config: EncodeMemoryConfig) -> str | None:
    """The tokenizer the chunks are cut and tokenized with: the given one, else the tokenizer.json of the export's
    decoder (what the served pyfunc tokenizes with) or of the encoder checkpoint, else the offline Qwen3 tokenizer."""
    if config.tokenizer:
        return config.tokenizer
    source = memory_store.encoder_source(config.model, config.encoder_attention)
    candidates = [source.checkpoint]
    if source.export is not None:
        decoder = Path(AwarenessConfig.load(source.export).decoder).expanduser()
        candidates.insert(0, decoder if decoder.is_absolute() else source.export / decoder)
    return next((str(c) for c in candidates if (c / "tokenizer.json").is_file()), None)


def load_memory_encoder(model: str, *, attention: str, dtype: torch.dtype, device: str) -> MemoryEncoder:
    """The encoder alone from its base checkpoint, unless the export trained encoder weights (then the whole export,
    so its LoRA or fully trained encoder weights apply)."""
    source = memory_store.encoder_source(model, attention)
    if source.trained:
        return AwarenessModel.from_pretrained(source.export, dtype=dtype, device=device).memory_encoder.eval()
    return MemoryEncoder(load_encoder(source.checkpoint, dtype=dtype, device=device), attention=source.attention).eval()


# ---------------------------------------------------------------------------------------------- Ray Data steps
def list_files(config: EncodeMemoryConfig) -> list[dict[str, Any]]:
    """Names only: the repository's candidate files (sources.walk_files), judged when read."""
    items = []
    for root in sources.check_sources(config.sources):
        items += [{"root": str(root), "path": rel, "source": root.name, "unit": root.name}
                  for rel in sources.walk_files(root)]
    if not items:
        raise ValueError(f"no source files under {config.sources} (extensions: "
                         f"{sorted(set(sources.CODE_EXTENSIONS) | set(sources.DOC_EXTENSIONS))})")
    return items


CHUNK_SCHEMA = pa.schema([("path", pa.string()), ("index", pa.int64()), ("start_line", pa.int64()),
                          ("end_line", pa.int64()), ("text", pa.string()), ("ids", pa.list_(pa.int64())),
                          ("reject", pa.string())])


def chunk_rows(batch: dict[str, Any], *, tokenizer: str | None, chunk_tokens: int, syntax_cuts: bool) -> pa.Table:
    """One row per chunk of each listed file, or one reject row (index -1, the reason) per input that cannot be used
    (a file, or a JSONL line)."""
    settings = tasks.Stage0Settings(chunk_tokens=chunk_tokens)
    rows = []
    for values in zip(*batch.values()):
        item = {k: str(v) for k, v in zip(batch, values)}
        for r in tasks.chunk_records(item, cached_tokenizer(tokenizer), settings, syntax_cuts=syntax_cuts):
            rows += [{"path": r["path"], "index": -1, "start_line": 0, "end_line": 0, "text": "", "ids": [],
                      "reject": r["reject"]}] if r["reject"] else []
            rows += [{"path": r["path"], "index": i, "start_line": int(lines[0]), "end_line": int(lines[1]),
                      "text": text, "ids": np.asarray(ids, dtype=np.int64).tolist(), "reject": ""}
                     for i, (text, ids, lines) in enumerate(zip(r["chunk_texts"], r["chunk_ids"], r["chunk_lines"]))]
    return pa.Table.from_pylist(rows, schema=CHUNK_SCHEMA)


class ChunkEncoder:
    """A Ray Data actor: holds the encoder, turns a batch of chunk rows into one shard of states under `out`, and
    returns the rows' metadata (reject rows pass through)."""

    def __init__(self, model: str, attention: str, dtype: str, out: str, use_gpu: bool,
                 store_dtype: str | None = None):
        self.device = "cuda" if use_gpu else "cpu"
        self.encoder = load_memory_encoder(model, attention=attention, dtype=DTYPES[dtype], device=self.device)
        self.out = out
        self.store_dtype = store_dtype

    @torch.no_grad()
    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        n = len(batch["path"])
        keep = [i for i in range(n) if not batch["reject"][i]]
        states = self.encode([list(batch["ids"][i]) for i in keep])
        keys = [f"{batch['path'][i]}#{int(batch['index'][i])}" for i in keep]
        ids = {key: list(batch["ids"][i]) for key, i in zip(keys, keep)}
        shard = memory_store.write_shard(self.out, dict(zip(keys, states)), ids, self.store_dtype) if keep else ""
        tokens, where = [0] * n, [""] * n
        for i, key, state in zip(keep, keys, states):
            tokens[i], where[i] = state.shape[0], key
        return {"path": list(batch["path"]), "index": [int(i) for i in batch["index"]],
                "start_line": [int(s) for s in batch["start_line"]], "end_line": [int(e) for e in batch["end_line"]],
                "text": list(batch["text"]), "reject": list(batch["reject"]), "tokens": tokens, "key": where,
                "shard": [shard if key else "" for key in where]}

    def encode(self, chunks: list[list[int]]) -> list[torch.Tensor]:
        """Each chunk alone (B, 1, L_max right-padded; the encoder counts positions over real tokens only), back to
        its own unpadded states (L_i, H_enc)."""
        if not chunks:
            return []
        width = max(len(c) for c in chunks)
        ids = torch.zeros((len(chunks), 1, width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, chunk in enumerate(chunks):
            ids[i, 0, : len(chunk)], mask[i, 0, : len(chunk)] = torch.tensor(chunk), 1
        states, _ = self.encoder(ids.to(self.device), mask.to(self.device))  # (B, L_max, H_enc)
        return [states[i, : len(c)].cpu() for i, c in enumerate(chunks)]


# ---------------------------------------------------------------------------------------------- the pipeline
def encode_repository(config: EncodeMemoryConfig, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Lists, chunks and encodes the repository into config.out; returns the manifest."""
    started = time.time()
    identity = memory_store.encoder_identity(config.model, dtype=config.torch_dtype,
                                             attention=config.encoder_attention)
    tokenizer = tokenizer_dir(config)
    items = list_files(config)
    progress(f"[encode_memory] {len(items)} files; encoder {identity.describe()}")
    out = memory_store.clear(config.out).resolve()
    dtype = str(config.torch_dtype).removeprefix("torch.")
    files = items_dataset(items, per_block=8)
    chunks = files.map_batches(chunk_rows, batch_size=8, batch_format="numpy", fn_kwargs={
        "tokenizer": tokenizer, "chunk_tokens": config.chunk_tokens, "syntax_cuts": config.syntax_cuts})
    encoded = map_with_actors(
        chunks, ChunkEncoder, actors=config.actors, batch_size=config.batch_size,
        cpus_per_actor=config.cpus_per_actor, use_gpu=config.use_gpu,
        constructor_kwargs={"model": config.model, "attention": config.encoder_attention, "dtype": dtype,
                            "out": str(out), "use_gpu": config.use_gpu, "store_dtype": config.store_dtype})
    rows = encoded.take_all()
    return finish(config, out, rows, identity, tokenizer, len(items), time.time() - started)


def finish(config: EncodeMemoryConfig, out: Path, rows: list[dict[str, Any]], identity, tokenizer: str | None,
           files: int, seconds: float) -> dict[str, Any]:
    """The manifest from the actors' rows: chunks in (path, index) order, rejected files counted by reason."""
    rejected = [r for r in rows if r["reject"]]
    kept = sorted((r for r in rows if not r["reject"]), key=lambda r: (r["path"], r["index"]))
    if not kept:
        raise ValueError(f"no chunk to encode under {config.sources}: {len(rejected)} of {files} files rejected")
    entries = [memory_store.chunk_entry(path=r["path"], index=r["index"], start_line=r["start_line"],
                                        end_line=r["end_line"], tokens=r["tokens"], shard=r["shard"], key=r["key"])
               for r in kept]
    reasons: dict[str, int] = {}
    for r in rejected:
        reasons[r["reject"]] = reasons.get(r["reject"], 0) + 1
    return memory_store.write_manifest(
        out, entries, [r["text"] for r in kept], identity, config.store_dtype,
        tokenizer=cached_tokenizer(tokenizer).name, sources=[str(s) for s in config.sources],
        chunk_tokens=config.chunk_tokens,
        files={"seen": files, "rejected": len(rejected)}, rejects=reasons,  # rejected: files (or JSONL lines)
        rejected_files=sorted(r["path"] for r in rejected), seconds=round(seconds, 1))
