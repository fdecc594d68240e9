"""The Ray Serve application: a registered model (`models:/NAME@ALIAS` through MLflow, or an export directory) behind
an HTTP API with memories as resources (pipelines.serving.memories) and batched, streamable completions.

    serve run pipelines/serving/awareness.yaml          (docs/serving.md)

Routes: POST /v1/memories {"chunks": [text, ...]} or {"files": [{path, text}, ...]} (a repository, chunked here) ->
{id, chunks, tokens, encoder, ...}; GET / DELETE /v1/memories/{id}; POST /v1/completions {prompt, memory, max_tokens,
temperature, stop, stream}.

Answers are the pyfunc's: the replica loads the very AwarenessPyfunc that `mlflow models serve` runs (its tokenizer,
end-of-answer token and decoding) and reads the memory the way the pyfunc reads a memory store, so a greedy answer here
equals `predict` for the same question over the same memory. A baseline (in_context, rag, none) is served the same
way: its memories are the chunk texts (pipelines.serving.memories.TextMemories) and each question's prompt holds them
as the pyfunc puts them there (all, the BM25 top-k, or none).

Batching: `@serve.batch` gathers the questions that arrive within `batch_wait_timeout_s` (up to `max_batch_size`)
from every client, and each group of them over one memory with one prompt length and the same decoding settings
runs as one `generate` over that memory's GCAMemory (batch 1: attention folds the group's rows onto it, so the
memory's keys and values are shared, not copied). We take that over a continuous-batching loop because this model's
decoding is transformers' `generate` (no paged KV cache, no step-level scheduler to admit a request mid-generation);
a continuous loop would need its own decoding loop and cache management, while serve.batch gives cross-client
batching at request granularity with Serve's own queueing, backpressure and metrics. Streaming requests decode alone
(a thread pushes each token as a server-sent event).
"""


import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow.pyfunc
import torch
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, model_validator
import ray
from ray import serve

from models import AwarenessConfig
from models.awareness import CONFIG_NAME, allowing_memory_keyword
from pipelines.corpora.tasks import readable_text, text_chunks
from pipelines.format.tokenizer import VOCAB_SIZE, QwenTokenizer
from pipelines.serving.memories import ID, MemoryCache, StoreMismatch, TextMemories, UnknownMemory
from pipelines.serving.pyfunc import AwarenessPyfunc, ensure_tokenizer, placement
from pipelines.tracking.tracker import for_other_nodes
# (no `from __future__ import annotations` here: FastAPI reads the route bodies' types from the annotations)

logger = logging.getLogger("ray.serve")
CREATE = 'create one with POST /v1/memories {"chunks": ["chunk text", ...]} or {"files": [{"path": ..., "text": ...}]}'
MAX_CHARS_PER_TOKEN = 16  # files larger than this many characters a memory token are refused before tokenizing
IN_CONTEXT_QUESTION_ROOM = 256  # decoder positions an in_context memory leaves for the question and its answer


class SourceFile(BaseModel):
    path: str = Field(min_length=1, max_length=1024)  # a label: it heads the file's chunks, nothing is opened by it
    text: str


class MemoryRequest(BaseModel):
    """Chunk texts, or a repository's files, chunked as the corpora chunk them (pipelines.corpora.tasks.text_chunks:
    code at tree-sitter nodes, each chunk headed by its path) into chunks of at most `chunk_tokens` tokens."""
    chunks: list[str] | None = Field(default=None, min_length=1)
    files: list[SourceFile] | None = Field(default=None, min_length=1)
    chunk_tokens: int = Field(default=512, ge=16, le=8192)

    @model_validator(mode="after")
    def one_source(self):
        if (self.chunks is None) == (self.files is None):
            raise ValueError('give "chunks" (chunk texts) or "files" ([{"path": ..., "text": ...}]: a repository to '
                             'chunk), one of the two')
        return self


class CompletionRequest(BaseModel):
    prompt: str
    memory: str | None = None
    max_tokens: int = Field(default=0, ge=0, le=4096)  # 0: the registered model's max_new_tokens
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    stop: str | list[str] | None = None
    stream: bool = False


app = FastAPI(title="Awareness")


def load_pyfunc(model: str, tracking_uri: str | None = None, device: str = "auto", dtype: str = "auto"):
    """The AwarenessPyfunc of a registered model (`models:/...`, `runs:/...`, a logged model directory) or of an
    export directory (awareness_config.json; the pyfunc's defaults), loaded onto `device` in `dtype`
    (pipelines.serving.pyfunc.placement: "auto" is a GPU when the process sees one, the checkpoints' dtype)."""
    where, wanted_dtype = placement(device, dtype)  # bad values fail here, before anything loads
    if (Path(model) / CONFIG_NAME).is_file():
        ensure_tokenizer(AwarenessConfig.load(Path(model)).decoder)  # a str from the YAML config, too
        pyfunc = AwarenessPyfunc()
        pyfunc.load_context(SimpleNamespace(artifacts={"export": str(model)},
                                            model_config={"device": device, "dtype": dtype}))
        return pyfunc
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    pyfunc = mlflow.pyfunc.load_model(model, model_config={"device": device, "dtype": dtype}).unwrap_python_model()
    loaded = pyfunc.model.device
    if loaded.type != where.type or (where.index is not None and loaded.index != where.index) or (
            wanted_dtype is not None and pyfunc.model.decoder.dtype != wanted_dtype):
        # a version registered before the pyfunc took a placement: MLflow drops model_config keys it was not logged with
        raise ValueError(f"{model} loaded on {loaded} in {pyfunc.model.decoder.dtype}, not the {device} / {dtype} "
                         f"asked for: it predates placement settings; register it again (jobs/register.py)")
    return pyfunc


def replica_tracking_uri(tracking_uri: str | None) -> str | None:
    """The tracking URI as this replica reaches it. A loopback URI names the MLflow server on the cluster's head
    (cluster.yaml runs it there, and `serve deploy` is run there): a replica on another node reaches it at the head's
    address. Unchanged on the head, on one machine, or for any other URI."""
    if not tracking_uri or not ray.is_initialized():
        return tracking_uri
    head = next((n["NodeManagerAddress"] for n in ray.nodes()
                 if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})), None)
    if head is None or head == ray.util.get_node_ip_address():
        return tracking_uri
    return for_other_nodes(tracking_uri, head)


@dataclass
class Pending:
    """One question waiting in a batch."""

    ids: list[int]
    memory: Any  # Memory | None
    max_tokens: int
    temperature: float
    first_token_at: list[float] = field(default_factory=list)


class _Timing:
    """A transformers streamer that notes when the first generated token exists (the first put is the prompt)."""

    def __init__(self, on_token=None):
        self.puts, self.first, self.on_token = 0, None, on_token

    def put(self, value):
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()
        if self.puts >= 2 and self.on_token:
            self.on_token(value)

    def end(self):
        if self.on_token:
            self.on_token(None)


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
@serve.ingress(app)
class AwarenessServer:
    def __init__(self, model: str, memory_dir: str, memory_budget_mb: float = 512.0, max_memory_tokens: int = 65536,
                 max_memory_chunks: int = 4096, tracking_uri: str | None = None, max_batch_size: int = 8,
                 batch_wait_timeout_s: float = 0.01, device: str = "auto", dtype: str = "auto"):
        self.pyfunc = load_pyfunc(model, replica_tracking_uri(tracking_uri), device, dtype)
        self.model_name = model
        self.reads = self.pyfunc.mode.kind  # gca: through the encoder; in_context / rag / none: in the prompt
        decoder = Path(self.pyfunc.model.config.decoder)
        # source files are chunked over the model's own tokenizer, which only a Qwen-vocabulary model has
        self.repository_tokenizer = (QwenTokenizer(decoder) if self.pyfunc.model.decoder.config.vocab_size >= VOCAB_SIZE
                                     else None)
        self.max_chunk_tokens = int(self.pyfunc.model.memory_encoder.encoder.config.max_position_embeddings)
        self.max_memory_tokens, self.max_memory_chunks = int(max_memory_tokens), int(max_memory_chunks)
        budget = int(memory_budget_mb * 2**20)
        if self.reads == "gca":
            self.memories = MemoryCache(memory_dir, budget, self.pyfunc.encoder_identity(),
                                        encode=self._encode_chunks, prepare=self._prepare)
        else:
            self.memories = TextMemories(memory_dir, budget, self.reads, tokenize=self.pyfunc.chunk_token_ids)
        if self.reads == "in_context":  # the whole memory goes in the prompt: the decoder's positions bound it
            positions = int(self.pyfunc.model.decoder.config.max_position_embeddings)
            self.max_memory_tokens = min(self.max_memory_tokens, positions - IN_CONTEXT_QUESTION_ROOM)
        self.generate_batch.set_max_batch_size(int(max_batch_size))
        self.generate_batch.set_batch_wait_timeout_s(float(batch_wait_timeout_s))
        self.model_lock = threading.Lock()  # one generate at a time per replica (torch uses every core it has)
        # where the time goes (GET /v1/stats): questions per serve.batch call, generate calls and seconds inside them
        self.batching = {"batches": 0, "questions": 0, "sizes": {}, "generates": 0, "generate_s": 0.0}

    # ------------------------------------------------------------------------------------------------- model
    def _encode_chunks(self, chunk_ids: list[list[int]]) -> list[torch.Tensor]:
        """Each chunk alone through the model's encoder (AwarenessPyfunc.encode_chunk_ids): its unpadded states."""
        with self.model_lock:
            return self.pyfunc.encode_chunk_ids(chunk_ids)

    @torch.no_grad()
    def _prepare(self, store):
        """The memory as the pyfunc reads a store, projected and turned into every GCA layer's K/V once."""
        model = self.pyfunc.model
        inputs = self.pyfunc.store_inputs(store)
        with self.model_lock:
            return model.prepare_memory(**inputs)

    def _generate(self, ids: list[list[int]], memory, max_tokens: int, temperature: float, streamer=None):
        model = self.pyfunc.model
        input_ids = torch.tensor(ids, device=model.device)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with self.model_lock, torch.no_grad(), allowing_memory_keyword(model.decoder):
            began = time.perf_counter()
            # the decoder's generate: every row of the group reads the one memory row (models.gca.attend_memory);
            # with lexical routing each row's question prior on a copy, the cached memory left as it was
            gca_memory = (model.with_question(memory.gca_memory, input_ids, torch.ones_like(input_ids))
                          if memory and memory.gca_memory is not None else None)
            out = model.decoder.generate(input_ids=input_ids, gca_memory=gca_memory,
                                         max_new_tokens=max_tokens, eos_token_id=self.pyfunc.eos_token_id,
                                         pad_token_id=self.pyfunc.pad_token_id, streamer=streamer, **sampling)
            self.batching["generates"] += 1
            self.batching["generate_s"] += time.perf_counter() - began
        return out[:, input_ids.shape[1]:].tolist()

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def generate_batch(self, requests: list[Pending]) -> list[tuple[list[int], float | None]]:
        sizes = self.batching["sizes"]
        self.batching["batches"] += 1
        self.batching["questions"] += len(requests)
        sizes[str(len(requests))] = sizes.get(str(len(requests)), 0) + 1
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            key = (r.memory.id if r.memory else None, len(r.ids), r.max_tokens, r.temperature)
            groups.setdefault(key, []).append(i)
        results: list[Any] = [None] * len(requests)
        for (_, _, max_tokens, temperature), members in groups.items():
            timing = _Timing()
            outs = await asyncio.to_thread(self._generate, [requests[i].ids for i in members],
                                           requests[members[0]].memory, max_tokens, temperature, timing)
            for i, out in zip(members, outs):
                results[i] = (out, timing.first)
        return results

    # ------------------------------------------------------------------------------------------------- memories
    def _memory(self, id: str):
        if not ID.match(id):
            raise HTTPException(404, f"no memory {id!r} (ids are 64 hex digits): {CREATE}")
        try:
            return self.memories.get(id)
        except UnknownMemory:
            raise HTTPException(404, f"no memory {id!r} on this server: {CREATE}") from None
        except StoreMismatch as e:
            raise HTTPException(409, str(e).replace(str(self.memories.directory), "MEMORY_DIR")) from None

    def _chunk_files(self, files: list[SourceFile], chunk_tokens: int) -> list[str]:
        """A repository's files as memory chunks, the corpora's chunker over the model's own tokenizer."""
        if self.repository_tokenizer is None:
            raise HTTPException(422, "this model reads the needle vocabulary (stage 0's synthetic task), which has "
                                     'no tokens for source files: send "chunks" instead of "files"')
        if chunk_tokens > self.max_chunk_tokens:
            raise HTTPException(422, f"chunk_tokens {chunk_tokens}: this model's encoder reads chunks of at most "
                                     f"{self.max_chunk_tokens} tokens")
        return [chunk.text for f in files for chunk in text_chunks(f.path, readable_text(f.path, f.text),
                                                                   self.repository_tokenizer, chunk_tokens)]

    @app.post("/v1/memories")
    async def create_memory(self, body: MemoryRequest):
        chunks = body.chunks
        if body.files is not None:
            size = sum(len(f.text) for f in body.files)
            if size > MAX_CHARS_PER_TOKEN * self.max_memory_tokens:  # refused before any tokenizing
                raise HTTPException(413, f"{size} characters of files: this server takes at most "
                                         f"{self.max_memory_tokens} tokens a memory")
            chunks = await asyncio.to_thread(self._chunk_files, body.files, body.chunk_tokens)
            if not chunks:
                raise HTTPException(422, "the files hold no text to remember")
        if len(chunks) > self.max_memory_chunks:
            raise HTTPException(413, f"{len(chunks)} chunks: this server takes at most "
                                     f"{self.max_memory_chunks} chunks and {self.max_memory_tokens} tokens a memory")
        token_ids = self.pyfunc.chunk_token_ids(chunks)
        tokens = sum(len(c) for c in token_ids)
        if tokens > self.max_memory_tokens:
            raise HTTPException(413, f"{tokens} tokens: this server takes at most {self.max_memory_tokens} tokens "
                                     f"(and {self.max_memory_chunks} chunks) a memory")
        if any(not c for c in token_ids):
            raise HTTPException(422, "every chunk needs at least one token")
        try:
            memory, how = await asyncio.to_thread(self.memories.create, chunks, token_ids)
        except StoreMismatch as e:
            raise HTTPException(409, str(e).replace(str(self.memories.directory), "MEMORY_DIR")) from None
        return JSONResponse(memory.describe() | {"source": how}, status_code=201 if how == "encoded" else 200)

    @app.get("/v1/memories/{id}")
    async def get_memory(self, id: str):
        memory, how = await asyncio.to_thread(self._memory, id)
        return memory.describe() | {"source": how}

    @app.delete("/v1/memories/{id}")
    async def delete_memory(self, id: str):
        if not ID.match(id):
            raise HTTPException(404, f"no memory {id!r}: {CREATE}")
        try:
            self.memories.delete(id)
        except UnknownMemory:
            raise HTTPException(404, f"no memory {id!r} on this server: {CREATE}") from None
        return {"id": id, "deleted": True}

    @app.get("/v1/stats")
    async def stats(self):
        with self.memories.lock:
            held = {"memories": len(self.memories.entries), "bytes": sum(m.nbytes for m in self.memories.entries.values())}
        return {"model": self.model_name, "budget_bytes": self.memories.budget_bytes, **held, **self.memories.counts,
                "batching": self.batching}

    # ------------------------------------------------------------------------------------------------- questions
    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        start = time.perf_counter()
        memory = (await asyncio.to_thread(self._memory, body.memory))[0] if body.memory else None
        ids = self.pyfunc.tokenizer.encode(body.prompt).ids
        if not ids:
            raise HTTPException(422, "the prompt has no tokens")
        vocab = self.pyfunc.model.decoder.config.vocab_size
        if max(ids) >= vocab:
            raise HTTPException(422, f"the prompt holds token ids >= the decoder's vocabulary ({vocab})")
        if self.reads != "gca":  # a baseline reads its memory in the prompt (all of it, its BM25 top-k, or none)
            ids = self.pyfunc.prompt_with_memory(ids, memory.chunk_ids if memory else [])
        max_tokens = body.max_tokens or self.pyfunc.max_new_tokens
        positions = self.pyfunc.model.decoder.config.max_position_embeddings
        if len(ids) > positions:  # the answer may run past them (rotary positions extrapolate), the prompt may not
            raise HTTPException(422, f"{len(ids)} prompt tokens{' with the memory' if self.reads != 'gca' else ''} "
                                     f"exceed the decoder's {positions} positions")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if body.stream:
            return StreamingResponse(self._stream(body, ids, memory, max_tokens, stops, start),
                                     media_type="text/event-stream")
        out, first = await self.generate_batch(Pending(ids, memory, max_tokens, body.temperature))
        text, reason = self._finish(out, stops, max_tokens)
        self._log(memory, len(ids), len(out), first, start)
        return {"object": "text_completion", "model": self.model_name, "memory": memory.id if memory else None,
                "choices": [{"index": 0, "text": text, "finish_reason": reason}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                          "total_tokens": len(ids) + len(out)}}

    def _answer_ids(self, out: list[int]) -> tuple[list[int], bool]:
        eos = self.pyfunc.eos_token_id if isinstance(self.pyfunc.eos_token_id, list) else [self.pyfunc.eos_token_id]
        end = next((i for i, token in enumerate(out) if token in eos), None)
        return (out if end is None else out[:end]), end is not None

    def _finish(self, out: list[int], stops: list[str], max_tokens: int) -> tuple[str, str]:
        answer, ended = self._answer_ids(out)
        text = self.pyfunc.decode(answer)
        cut = min((text.index(s) for s in stops if s and s in text), default=None)
        if cut is not None:
            return text[:cut], "stop"
        return text, "stop" if ended or len(out) < max_tokens else "length"

    async def _stream(self, body: CompletionRequest, ids, memory, max_tokens: int, stops: list[str], start: float):
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        timing = _Timing(lambda value: loop.call_soon_threadsafe(
            queue.put_nowait, None if value is None else value.reshape(-1).tolist()))
        task = asyncio.ensure_future(asyncio.to_thread(self._generate, [ids], memory, max_tokens, body.temperature,
                                                       timing))
        out, sent, done = [], "", False
        while not done:
            step = await queue.get()
            if step is None:
                break
            out += step
            answer, ended = self._answer_ids(out)
            text = self.pyfunc.decode(answer)
            cut = min((text.index(s) for s in stops if s and s in text), default=None)
            if cut is not None:
                text, done = text[:cut], True
            if ended:
                done = True
            if len(text) > len(sent) and text.startswith(sent):
                yield self._event({"choices": [{"index": 0, "text": text[len(sent):], "finish_reason": None}]})
                sent = text
        await task
        final, reason = self._finish(out, stops, max_tokens)
        if final.startswith(sent) and len(final) > len(sent):
            yield self._event({"choices": [{"index": 0, "text": final[len(sent):], "finish_reason": None}]})
        yield self._event({"choices": [{"index": 0, "text": "", "finish_reason": reason}]})
        yield "data: [DONE]\n\n"
        self._log(memory, len(ids), len(out), timing.first, start)

    @staticmethod
    def _event(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def _log(self, memory, tokens_in: int, tokens_out: int, first: float | None, start: float) -> None:
        now = time.perf_counter()
        ttft = f"{(first - start) * 1000:.1f}" if first else "-"
        logger.info(f"completion memory={memory.id[:12] if memory else '-'} tokens_in={tokens_in} "
                    f"tokens_out={tokens_out} ttft_ms={ttft} latency_ms={(now - start) * 1000:.1f}")


def build(args: dict[str, Any]):
    """The application for `serve run` / `serve deploy` (import_path: pipelines.serving.app:build): `args` are
    AwarenessServer's keyword arguments (model, memory_dir, memory_budget_mb, max_memory_tokens, ...); the tracking
    server comes from `tracking_uri` or MLFLOW_TRACKING_URI."""
    args = dict(args)
    args.setdefault("tracking_uri", os.environ.get("MLFLOW_TRACKING_URI"))
    return AwarenessServer.bind(**args)
