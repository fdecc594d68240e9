"""The Ray Serve application: a registered model (`models:/NAME@ALIAS` through MLflow, or an export directory) behind
an HTTP API with memories as resources (pipelines.serving.memories) and batched, streamable completions in OpenAI's
wire format.

    serve run pipelines/serving/awareness.yaml          (docs/serving.md)

Routes: POST /v1/memories {"chunks": [text, ...]} or {"files": [{path, text}, ...]} (a repository, chunked here) ->
{id, chunks, tokens, encoder, ...}; GET / DELETE /v1/memories/{id}; POST /v1/completions (OpenAI's legacy completions:
prompt, max_tokens, temperature, top_p, n, seed, stop, stream, stream_options, plus this server's `memory`);
GET /v1/models; GET /v1/stats (an admin key); GET /openapi.json.

Access: every route answers to an API key (`Authorization: Bearer KEY`), read at start from a file or an environment
variable the Serve config names (`api_keys_file`, `api_keys_env`; never from the repository). Each key names its owner
and may be an admin key (GET /v1/stats). A memory belongs to the owner whose key made it: to every other key it is
absent (404, the same answer as for an id nobody made). With no keys configured the server answers loopback clients
only, says so in its log at start, and refuses to start when Serve's HTTP host is not a loopback address.

Answers are the pyfunc's: the replica loads the very AwarenessPyfunc that `mlflow models serve` runs (its tokenizer,
end-of-answer token and decoding) and reads the memory the way the pyfunc reads a memory store, so a greedy answer here
equals `predict` for the same question over the same memory. A baseline (in_context, rag, none) is served the same
way: its memories are the chunk texts (pipelines.serving.memories.TextMemories) and each question's prompt holds them
as the pyfunc puts them there (all, the BM25 top-k, or none).

Bounds: a request body over `max_request_mb` is refused (413) before it is read; request fields are strict (no "4" for
4, no 0 for false) and finite; a memory's chunks are checked against the encoder's positions before encoding; every
owner's memories on disk have a budget; every generate stops at the request's time limit (`request_timeout_s`) or
when a streaming client leaves; a stream that fails sends an error event and ends; Serve's `max_ongoing_requests` and
`max_queued_requests` answer overload with 503 and Retry-After.

Batching: continuous (pipelines.serving.decoding): one decoding loop per replica admits new questions at every
step, plain and streamed alike, up to `max_batch_size` rows decoding at once; rows over one memory read its prepared
GCA keys/values together (shared, not copied). A streamed request gets each token as the loop makes it.
"""


import asyncio
import copy
import hmac
import ipaddress
import json
import logging
import os
import re
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal

import mlflow.pyfunc
import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator,
                      model_validator)
import ray
from ray import serve
from ray.serve import metrics
from ray.serve.config import BackpressureConfig
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from models import AwarenessConfig
from models.awareness import CONFIG_NAME
from models.quantization import check_quantize, is_quantized
from pipelines.corpora.tasks import readable_text, text_chunks
from pipelines.format.tokenizer import VOCAB_SIZE, QwenTokenizer
from pipelines.serving.decoding import MIN_TEMPERATURE, DecodingLoop, Question
from pipelines.serving.memories import ID, MemoryCache, OverDiskBudget, StoreMismatch, TextMemories, UnknownMemory
from pipelines.serving.pyfunc import AwarenessPyfunc, ensure_tokenizer, placement
from pipelines.tracking.tracker import for_other_nodes
# (no `from __future__ import annotations` here: FastAPI reads the route bodies' types from the annotations)

logger = logging.getLogger("ray.serve")
CREATE = 'create one with POST /v1/memories {"chunks": ["chunk text", ...]} or {"files": [{"path": ..., "text": ...}]}'
MAX_CHARS_PER_TOKEN = 16  # files larger than this many characters a memory token are refused before tokenizing
IN_CONTEXT_QUESTION_ROOM = 256  # decoder positions an in_context memory leaves for the question and its answer
# a chunk or prompt holds some text: a character no regex dialect or tokenizer calls whitespace (Unicode's White_Space,
# Python's \s, ECMAScript's \s), spelled out so that the schema's `pattern` and this check agree everywhere
NON_BLANK = re.compile(r"[^\t\n\x0b\x0c\r\x1c-\x1f \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]")
MAX_PROMPTS = 8  # prompts a completion request may list (each answered n times)
MAX_TOKENS = 4096  # the most new tokens a completion may ask for (a server's max_tokens_limit may be lower)
LOCAL_OWNER = "local"  # the owner of every memory on a server without keys (loopback clients only)
KEYS_FIX = "set api_keys_file or api_keys_env in the Serve config's args (docs/serving.md)"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
               422: "invalid_request_error", 503: "server_error", 504: "timeout_error"}


# --------------------------------------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class ApiKey:
    owner: str
    secret: str = field(repr=False)
    admin: bool = False


def parse_keys(text: str, where: str) -> list[ApiKey]:
    """Entries `OWNER:KEY` or `OWNER:KEY:admin`, separated by newlines, commas or spaces (`#` starts a comment to the
    end of its line). A key has at least 16 characters; an owner names whose memories a key reaches (two keys of one
    owner share them, so a key can be replaced without losing them)."""
    keys = []
    for line in text.splitlines():
        for entry in line.split("#", 1)[0].replace(",", " ").split():
            parts = entry.split(":")
            if len(parts) not in (2, 3) or not parts[0] or (len(parts) == 3 and parts[2] != "admin"):
                raise ValueError(f"{where}: an entry is not OWNER:KEY or OWNER:KEY:admin")
            if len(parts[1]) < 16:
                raise ValueError(f"{where}: the key of {parts[0]!r} has {len(parts[1])} characters; use 16 or more "
                                 f"(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
            keys.append(ApiKey(parts[0], parts[1], len(parts) == 3))
    if len({k.secret for k in keys}) != len(keys):
        raise ValueError(f"{where}: a key is listed twice")
    return keys


def load_keys(api_keys_file: str | None, api_keys_env: str | None) -> list[ApiKey] | None:
    """The keys of the file and the environment variable the config names; None when it names neither."""
    if not api_keys_file and not api_keys_env:
        return None
    keys = []
    if api_keys_file:
        path = Path(api_keys_file).expanduser()
        if not path.is_file():
            raise ValueError(f"api_keys_file {api_keys_file}: no such file on this node; create it (OWNER:KEY a line)")
        keys += parse_keys(path.read_text(), f"api_keys_file {api_keys_file}")
    if api_keys_env:
        if api_keys_env not in os.environ:
            raise ValueError(f"api_keys_env names {api_keys_env}, which the replica's environment does not set: "
                             f"export it where `serve run` / `ray start` runs (OWNER:KEY,...)")
        keys += parse_keys(os.environ[api_keys_env], f"environment variable {api_keys_env}")
    if not keys:
        raise ValueError(f"the configured API keys ({api_keys_file or ''} {api_keys_env or ''}) hold no key")
    return keys


def find_key(keys: list[ApiKey], presented: str) -> ApiKey | None:
    """The key equal to `presented`, compared in constant time against every key (no early exit)."""
    found = None
    for key in keys:
        if hmac.compare_digest(key.secret.encode(), presented.encode()):
            found = key
    return found


def is_loopback(host: str | None) -> bool:
    if host in ("localhost", "testclient"):
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def check_open_host(host: str | None, keys: list[ApiKey] | None) -> None:
    """A server without keys may listen on loopback only."""
    if keys is None and host is not None and not is_loopback(host):
        raise ValueError(f"no API keys are configured and Serve's HTTP host is {host}, not loopback: {KEYS_FIX}, "
                         f"or serve on http_options.host 127.0.0.1")


def serve_http_host() -> str | None:
    """The HTTP host Serve's proxies listen on, as its controller has it (None where there is no controller)."""
    from ray.serve.context import _get_global_client  # Serve's own client to its controller; no public accessor

    client = _get_global_client(raise_if_no_controller_running=False)
    return client.http_config.host if client is not None else None


@dataclass(frozen=True)
class Caller:
    owner: str
    admin: bool


def caller(request: Request) -> Caller:
    """The key's owner (a FastAPI dependency: it runs before the body is read or validated)."""
    return serve.get_replica_context().servable_object.authorize(request)


def admin_caller(who: Caller = Depends(caller)) -> Caller:
    if not who.admin:
        raise ApiError(403, "this route answers to an admin key (OWNER:KEY:admin in the configured keys)",
                       "admin_key_required")
    return who


# ------------------------------------------------------------------------------------------------------- errors
class ApiError(HTTPException):
    """An error in OpenAI's shape: {"error": {"message", "type", "code", "param"}}."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.code, self.param = code, param


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "code": code,
                      "param": param}}


class ErrorCounts:
    """The errors a replica answered, by status and reason (the error's `code`): in GET /v1/stats' `errors`, and as
    Ray Serve metrics (on each node's Prometheus endpoint, tagged with the deployment, replica and application):
    `ray_awareness_errors_total{status, reason}` and, for a 401, `ray_awareness_rejected_keys_total{reason}`
    (missing_api_key, invalid_api_key, no_keys_configured)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.errors = metrics.Counter("awareness_errors", "error responses by status and reason",
                                      tag_keys=("status", "reason"))
        self.rejected_keys = metrics.Counter("awareness_rejected_keys", "requests refused for their API key",
                                             tag_keys=("reason",))

    def count(self, status: int, reason: str | None) -> None:
        reason = reason or "unknown"
        self.counts[f"{status} {reason}"] += 1
        self.errors.inc(tags={"status": str(status), "reason": reason})
        if status == 401:
            self.rejected_keys.inc(tags={"reason": reason})


def _count(status: int, code: str | None) -> None:
    """An error response, counted by the replica answering it (nothing outside a replica)."""
    try:
        server = serve.get_replica_context().servable_object
    except Exception:  # noqa: BLE001 - no replica context (the app without Serve)
        return
    server.errors.count(status, code)


class BodyLimit:
    """Refuses a request body over the replica's `max_request_bytes` with 413: by its Content-Length before reading
    it, and by counting what arrives when there is none (chunked)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = serve.get_replica_context().servable_object.max_request_bytes
        length = dict(scope.get("headers") or []).get(b"content-length")
        message = f"the request body is over this server's {limit} bytes (max_request_mb): send less"
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self._refuse(send, message)
        received = 0

        async def counted():  # read by the route's body parsing: its 413 is answered as any HTTPException
            nonlocal received
            got = await receive()
            received += len(got.get("body", b""))
            if received > limit:
                raise ApiError(413, message, "request_too_large")
            return got

        await self.app(scope, counted, send)

    @staticmethod
    async def _refuse(send, message: str) -> None:
        _count(413, "request_too_large")
        response = JSONResponse(error_body(413, message, "request_too_large"), status_code=413)
        await response({"type": "http"}, None, send)


app = FastAPI(title="Awareness", docs_url=None, redoc_url=None, openapi_url=None,
              description="Completions over memories (OpenAI's legacy completions wire format, plus `memory`: the "
                          "id of a memory made with POST /v1/memories). Every route takes `Authorization: Bearer "
                          "KEY`.")
app.add_middleware(BodyLimit)


@app.exception_handler(StarletteHTTPException)
async def http_error(request: Request, exc: StarletteHTTPException):
    code = getattr(exc, "code", None) or {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    _count(exc.status_code, code)
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        headers = (headers or {}) | {"Allow": allowed_methods(request)}
    return JSONResponse(error_body(exc.status_code, str(exc.detail), code, getattr(exc, "param", None)),
                        status_code=exc.status_code, headers=headers)


def _type_tag(part: str | int) -> bool:
    """A part of a pydantic error's location naming a type (a union's member: `str`, `list[...]`,
    `function-after[...]`), not a field."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


@app.exception_handler(RequestValidationError)
async def invalid_request(request: Request, exc: RequestValidationError):
    """422 naming each bad field and what it needs; the input is not echoed (it may be NaN, or not text)."""
    errors = exc.errors()
    where = [".".join(str(p) for p in e.get("loc", ()) if p != "body" and not _type_tag(p)) for e in errors]
    message = "; ".join(f"{w or 'body'}: {e.get('msg', 'invalid')}" for w, e in zip(where, errors))
    _count(422, "invalid_request")
    return JSONResponse(error_body(422, message, "invalid_request", where[0] if where else None), status_code=422)


@app.exception_handler(Exception)
async def server_error(request: Request, exc: Exception):
    _count(500, "internal_error")
    return JSONResponse(error_body(500, "the server failed on this request (its log says why); it was not kept",
                                   "internal_error"), status_code=500)


# ------------------------------------------------------------------------------------------------------ requests
def _valid_text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds {text[e.start]!r} at {e.start}, a lone surrogate, which is not text: send valid "
                         f"UTF-8") from None
    return text


def _has_text(text: str) -> str:
    if not NON_BLANK.search(text):
        raise ValueError("holds only whitespace: send text")
    return text


def _integral(value):
    """4.0 is the integer 4 in JSON Schema's terms (and the schema's `integer`): taken as 4. "4", true, 4.5 stay
    themselves, for the strict check to refuse."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Text = Annotated[str, AfterValidator(_valid_text)]


def integer(**bounds: int) -> Any:
    """A strict int within `bounds` (ge, le) that takes 4.0 as 4 (_integral)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]
# a memory chunk or a prompt holds some non-whitespace (the needle tokenizer gives whitespace no tokens): the schema's
# `pattern`; a chunk's is checked here, a prompt's by the route (the prompt's union would muddle the message)
NonBlank = Field(json_schema_extra={"pattern": NON_BLANK.pattern})
Chunk = Annotated[str, AfterValidator(_valid_text), AfterValidator(_has_text), NonBlank]
Prompt = Annotated[str, AfterValidator(_valid_text), NonBlank]
STRICT = ConfigDict(strict=True, extra="forbid")


class SourceFile(BaseModel):
    model_config = STRICT
    path: Text = Field(min_length=1, max_length=1024)  # a label: it heads the file's chunks, nothing is opened by it
    text: Text


def _one_source_schema(schema: dict[str, Any]) -> None:
    """MemoryRequest's JSON schema: exactly one of chunks and files, chunk_tokens only with files (what
    MemoryRequest.one_source checks)."""
    for name in ("chunks", "files"):
        schema["properties"][name].pop("default", None)  # absent, never null
    schema["oneOf"] = [{"required": ["chunks"], "not": {"anyOf": [{"required": ["files"]},
                                                                  {"required": ["chunk_tokens"]}]}},
                       {"required": ["files"], "not": {"required": ["chunks"]}}]


class MemoryRequest(BaseModel):
    """Chunk texts, or a repository's files, chunked as the corpora chunk them (pipelines.corpora.tasks.text_chunks:
    code at tree-sitter nodes, each chunk headed by its path) into chunks of at most `chunk_tokens` tokens."""
    model_config = STRICT | ConfigDict(json_schema_extra=_one_source_schema)
    chunks: list[Chunk] = Field(default=None, min_length=1)  # absent (None) when files are given; null is refused
    files: list[SourceFile] = Field(default=None, min_length=1)
    chunk_tokens: integer(ge=16, le=8192) = 512

    @model_validator(mode="before")
    @classmethod
    def one_source(cls, data):
        if isinstance(data, dict):
            if ("chunks" in data) == ("files" in data):
                raise ValueError('give "chunks" (chunk texts) or "files" ([{"path": ..., "text": ...}]: a repository '
                                 'to chunk), one of the two')
            if "chunk_tokens" in data and "files" not in data:
                raise ValueError("chunk_tokens is how files are chunked: leave it out with chunks")
        return data


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


def _one_stream_schema(schema: dict[str, Any]) -> None:
    """CompletionRequest's JSON schema: a stream answers one prompt with one choice, and only a stream takes
    stream_options (what CompletionRequest.consistent checks)."""
    schema["anyOf"] = [{"properties": {"stream": {"const": False}, "stream_options": {"type": "null"}}},
                       {"required": ["stream"], "properties": {
                           "stream": {"const": True}, "n": {"const": 1},
                           "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": 1}]}}}]


class CompletionRequest(BaseModel):
    """OpenAI's completion request, the fields this server honours; any other field is refused (422 naming it)."""
    model_config = STRICT | ConfigDict(json_schema_extra=_one_stream_schema)
    model: Text | None = None  # GET /v1/models names the one served; another name is 404
    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)] = Field(
        description=f"a prompt, or a list of up to {MAX_PROMPTS} prompts answered as one batch")
    memory: Text | None = Field(default=None, description="this server's extension: the id of a memory to read")
    max_tokens: integer(ge=1, le=MAX_TOKENS) | None = Field(default=None, description="default: the registered model's")
    temperature: float = Field(default=0.0, ge=0.0, le=10.0, allow_inf_nan=False,
                               description=f"0 (default) or below {MIN_TEMPERATURE}: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: integer(ge=1, le=8) = 1
    seed: integer(ge=0, le=2**53 - 1) | None = Field(  # JSON numbers are exact to 2**53
        default=None, description="choice j of a seeded request samples with seed + j: the same seed, the same answer")
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # refused when given (the schema says: null only), so that a client asking for them hears why
    logprobs: Annotated[int | None, WithJsonSchema({"type": "null", "description": "none returned: leave it out"})] = (
        None)

    @field_validator("logprobs")
    @classmethod
    def no_logprobs(cls, value):
        if value is not None:
            raise ValueError("this server returns no log probabilities: leave logprobs out")
        return value

    @model_validator(mode="after")
    def consistent(self):
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if self.stream and (len(prompts) > 1 or self.n > 1):
            raise ValueError("a stream answers one prompt with one choice: send n=1 and one prompt, or stream=false")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only for stream=true")
        return self


# ------------------------------------------------------------------------------------------------------ responses
class ErrorDetail(BaseModel):
    message: str = Field(description="the problem and its fix")
    type: str
    code: str | None = Field(description="the reason, e.g. memory_not_found, invalid_request, request_too_large")
    param: str | None = Field(description="the request field at fault, when one is")


class ErrorResponse(BaseModel):
    """Every error the app answers (OpenAI's shape)."""
    error: ErrorDetail


class MemoryResponse(BaseModel):
    id: str = Field(pattern=ID.pattern)
    object: Literal["memory"]
    chunks: int
    tokens: int
    bytes: int
    encoder: dict[str, Any] | None = Field(description="the encoder's identity (no path); null for a baseline")
    source: Literal["encoded", "cache", "disk"] = Field(description="made now, or found warm, or read from disk")


class DeletedResponse(BaseModel):
    id: str
    object: Literal["memory"]
    deleted: Literal[True]


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    memory: str | None = Field(description="this server's extension: the memory read")
    choices: list[Choice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One event of a streamed completion (`data: {...}`)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[Choice] = Field(description="one: the text since the last event; none in the usage event")
    usage: Usage | None = Field(default=None, description="only with stream_options.include_usage: null, then the "
                                                          "last event's")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    reads: str = Field(description="how the model reads a memory: gca, in_context, rag or none")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


SSE = {"text/event-stream": {"schema": {
    "description": "with stream=true: one CompletionChunk an event, the last with its finish_reason, then one with "
                   "`usage` when stream_options.include_usage, then `data: [DONE]`; a stream that fails ends with an "
                   "ErrorResponse event and no [DONE]",
    "type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"$ref": "#/components/schemas/CompletionChunk"},
            {"$ref": "#/components/schemas/ErrorResponse"}]}}}}}}}
WHY = {400: "a body that is not JSON text (not UTF-8)",
       401: "no API key, or not a valid one (WWW-Authenticate: Bearer)", 403: "not an admin key",
       404: "no such memory for this key (or no such model)", 409: "a memory on disk another encoder made",
       413: "the body over max_request_mb, or a memory over a size limit or its owner's disk budget",
       422: "a malformed body or field (the message names it)",
       504: "the request ran past request_timeout_s", 503: "overloaded: Ray Serve's answer, with Retry-After"}


def answers(success: dict[int, dict[str, Any]], *errors: int) -> dict[int | str, dict[str, Any]]:
    """A route's OpenAPI `responses`: its successes, then each error status as ErrorResponse (JSON): 401, 413 and 503
    besides `errors`, since every route can answer them; 503 is Ray Serve's own (plain text, Retry-After)."""
    documented: dict[int | str, dict[str, Any]] = dict(success)
    for status in sorted({401, 413, *errors}):
        documented[status] = {"model": ErrorResponse, "description": WHY[status]}
    documented[503] = {"description": WHY[503], "content": {"text/plain": {"schema": {"type": "string"}}},
                       "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}}
    return documented


def served_schema(schema: dict[str, Any], *, model_name: str, max_tokens: int, max_chunk_tokens: int,
                  max_chunks: int, files: bool) -> dict[str, Any]:
    """The OpenAPI schema as a replica answers it (GET /openapi.json): the app's, with the bearer key every route
    takes, without FastAPI's own 422 (HTTPValidationError: this app answers 422 as ErrorResponse, and a route with
    nothing to validate none), and with this replica's limits: the most max_tokens, chunk_tokens (its encoder's
    positions) and chunks, no `files` for a model without a tokenizer for them, and the model's name."""
    schema = copy.deepcopy(schema)
    schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearer": []}]
    for operation in (op for path in schema["paths"].values() for op in path.values()):
        if "HTTPValidationError" in json.dumps(operation["responses"].get("422", {})):
            del operation["responses"]["422"]
    shapes = schema["components"]["schemas"]
    for unused in ("HTTPValidationError", "ValidationError"):
        shapes.pop(unused, None)
    chunk = CompletionChunk.model_json_schema(ref_template="#/components/schemas/{model}")
    shapes |= chunk.pop("$defs", {}) | {"CompletionChunk": chunk}  # the stream's events (SSE) refer to it
    for parameter in schema["paths"]["/v1/models/{name}"]["get"]["parameters"]:
        parameter["schema"]["examples"] = [model_name]
    shapes["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] = max_tokens
    memory = shapes["MemoryRequest"]
    memory["properties"]["chunks"]["maxItems"] = max_chunks
    memory["properties"]["chunk_tokens"]["maximum"] = min(memory["properties"]["chunk_tokens"]["maximum"],
                                                          max_chunk_tokens)
    if not files:
        del memory["properties"]["files"], memory["properties"]["chunk_tokens"], memory["oneOf"]
        memory["required"] = ["chunks"]
    return schema


def allowed_methods(request: Request) -> str:
    """The Allow header of a 405: the methods the schema gives the request's path (Starlette names one route's)."""
    paths = app.openapi()["paths"]
    return ", ".join(sorted({method.upper() for template, operations in paths.items()
                             if compile_path(template)[0].match(request.url.path) for method in operations}))


def load_pyfunc(model: str, tracking_uri: str | None = None, device: str = "auto", dtype: str = "auto",
                quantize: str = "none"):
    """The AwarenessPyfunc of a registered model (`models:/...`, `runs:/...`, a logged model directory) or of an
    export directory (awareness_config.json; the pyfunc's defaults), loaded onto `device` in `dtype`
    (pipelines.serving.pyfunc.placement: "auto" is a GPU when the process sees one, the checkpoints' dtype), its
    frozen base weights in `quantize`'s bits (none | nf4 | int8: models.quantization)."""
    where, wanted_dtype = placement(device, dtype)  # bad values fail here, before anything loads
    check_quantize(quantize)
    settings = {"device": device, "dtype": dtype, "quantize": quantize}
    if (Path(model) / CONFIG_NAME).is_file():
        ensure_tokenizer(AwarenessConfig.load(Path(model)).decoder)  # a str from the YAML config, too
        pyfunc = AwarenessPyfunc()
        pyfunc.load_context(SimpleNamespace(artifacts={"export": str(model)}, model_config=settings))
        return pyfunc
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    pyfunc = mlflow.pyfunc.load_model(model, model_config=settings).unwrap_python_model()
    loaded = pyfunc.model.device
    if loaded.type != where.type or (where.index is not None and loaded.index != where.index) or (
            wanted_dtype is not None and pyfunc.model.decoder.dtype != wanted_dtype) or (
            quantize != "none" and not is_quantized(pyfunc.model.decoder)):
        # a version registered before the pyfunc took a placement: MLflow drops model_config keys it was not logged with
        raise ValueError(f"{model} loaded on {loaded} in {pyfunc.model.decoder.dtype}, not the {device} / {dtype} / "
                         f"quantize {quantize} asked for: it predates these placement settings; register it again "
                         f"(jobs/register.py)")
    return pyfunc


def served_model_name(model: str, configured: str | None = None) -> str:
    """The name responses give the model: the configured one, else a registered model's NAME/VERSION (an alias
    resolved in the registry the pyfunc was loaded from), else an export directory's own name (never its path)."""
    if configured:
        return configured
    if model.startswith("models:/"):
        ref = model[len("models:/"):].strip("/")
        name, _, alias = ref.partition("@")
        if alias:
            return f"{name}/{mlflow.MlflowClient().get_model_version_by_alias(name, alias).version}"
        return ref
    if model.startswith("runs:/"):
        return "run-" + model[len("runs:/"):].strip("/").split("/")[0]
    return Path(model).resolve().name


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


# overload past max_ongoing_requests + max_queued_requests: Serve answers 503 with Retry-After itself. A request
# inside the replica waits for a decoding row in the loop's own queue, at no cost; one held back by Serve's router
# waits out its retry backoff, so max_ongoing_requests sits well above max_batch_size
@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=256, max_queued_requests=512,
                  backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1))
@serve.ingress(app)
class AwarenessServer:
    def __init__(self, model: str, memory_dir: str, memory_budget_mb: float = 512.0, max_memory_tokens: int = 65536,
                 max_memory_chunks: int = 4096, tracking_uri: str | None = None, max_batch_size: int = 128,
                 device: str = "auto", dtype: str = "auto", quantize: str = "none",
                 api_keys_file: str | None = None, api_keys_env: str | None = None, model_name: str | None = None,
                 memory_disk_mb_per_owner: float = 4096.0, max_request_mb: float = 8.0,
                 request_timeout_s: float = 60.0, max_tokens_limit: int = MAX_TOKENS):
        self.keys = load_keys(api_keys_file, api_keys_env)  # before the model: a bad key file fails at once
        check_open_host(serve_http_host(), self.keys)
        if self.keys is None:
            logger.warning(f"no API keys configured: answering loopback clients only, without keys ({KEYS_FIX})")
        else:
            logger.info(f"{len(self.keys)} API keys of {len({k.owner for k in self.keys})} owners "
                        f"({sum(k.admin for k in self.keys)} admin)")
        self.max_request_bytes = int(max_request_mb * 2**20)
        self.request_timeout_s = float(request_timeout_s)
        if not 1 <= int(max_tokens_limit) <= MAX_TOKENS:
            raise ValueError(f"max_tokens_limit {max_tokens_limit}: give 1 to {MAX_TOKENS}")
        self.max_tokens_limit = int(max_tokens_limit)
        self.schema: dict[str, Any] | None = None  # GET /openapi.json: the app's with this replica's limits
        self.errors = ErrorCounts()
        self.pyfunc = load_pyfunc(model, replica_tracking_uri(tracking_uri), device, dtype, quantize)
        self.model_name = served_model_name(model, model_name)
        self.created = int(time.time())
        self.reads = self.pyfunc.mode.kind  # gca: through the encoder; in_context / rag / none: in the prompt
        decoder = Path(self.pyfunc.model.config.decoder)
        # source files are chunked over the model's own tokenizer, which only a Qwen-vocabulary model has
        self.repository_tokenizer = (QwenTokenizer(decoder) if self.pyfunc.model.decoder.config.vocab_size >= VOCAB_SIZE
                                     else None)
        self.max_chunk_tokens = int(self.pyfunc.model.memory_encoder.encoder.config.max_position_embeddings)
        self.max_memory_tokens, self.max_memory_chunks = int(max_memory_tokens), int(max_memory_chunks)
        budget, disk = int(memory_budget_mb * 2**20), int(memory_disk_mb_per_owner * 2**20)
        if self.reads == "gca":
            self.memories = MemoryCache(memory_dir, budget, self.pyfunc.encoder_identity(), encode=self._encode_chunks,
                                        prepare=self._prepare, disk_budget_bytes=disk)
        else:
            self.memories = TextMemories(memory_dir, budget, self.reads, tokenize=self.pyfunc.chunk_token_ids,
                                         disk_budget_bytes=disk)
        if self.reads == "in_context":  # the whole memory goes in the prompt: the decoder's positions bound it
            positions = int(self.pyfunc.model.decoder.config.max_position_embeddings)
            self.max_memory_tokens = min(self.max_memory_tokens, positions - IN_CONTEXT_QUESTION_ROOM)
        self.model_lock = threading.Lock()  # one forward at a time per replica (torch uses every core it has)
        eos = self.pyfunc.eos_token_id
        self.decoding = DecodingLoop(self.pyfunc.model, eos if isinstance(eos, list) else [eos], int(max_batch_size),
                                     self.model_lock)

    def authorize(self, request: Request) -> Caller:
        """The caller of a request: its key's owner; without keys configured, any loopback client (as LOCAL_OWNER,
        an admin). 401 otherwise."""
        challenge = {"WWW-Authenticate": "Bearer"}
        if self.keys is None:
            if is_loopback(request.client.host if request.client else None):
                return Caller(LOCAL_OWNER, True)
            raise ApiError(401, f"this server has no API keys and answers loopback clients only: {KEYS_FIX}",
                           "no_keys_configured", headers=challenge)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "no API key: send the header 'Authorization: Bearer YOUR_KEY'", "missing_api_key",
                           headers=challenge)
        key = find_key(self.keys, token.strip())
        if key is None:
            raise ApiError(401, "that API key is not valid here: check it with whoever runs this server",
                           "invalid_api_key", headers=challenge)
        return Caller(key.owner, key.admin)

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

    async def _answered(self, questions: list[Question]) -> None:
        """Until the decoding loop has ended every question; a request that is cancelled (its client left) ends its
        questions at the loop's next step."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in questions]

        def resolve(done: asyncio.Future) -> None:  # (nested: Serve ships this class's methods by value)
            if not done.done():
                done.set_result(None)

        for q, done in zip(questions, futures):
            q.on_done = lambda _, done=done: loop.call_soon_threadsafe(resolve, done)
            self.decoding.submit(q)
        try:
            await asyncio.gather(*futures)
        finally:
            for q in questions:
                q.cancel()

    # ------------------------------------------------------------------------------------------------- memories
    def _memory(self, owner: str, id: str):
        if not ID.match(id):
            raise ApiError(404, f"no such memory (ids are 64 hex digits): {CREATE}", "memory_not_found", "memory")
        try:
            return self.memories.get(owner, id)
        except UnknownMemory:  # absent, or another owner's: one answer
            raise ApiError(404, f"no memory {id} for this key: {CREATE}", "memory_not_found", "memory") from None
        except StoreMismatch:
            raise ApiError(409, f"memory {id} on this server was encoded by another encoder than this model's: "
                                f"{CREATE} again", "encoder_mismatch", "memory") from None

    def _chunk_files(self, files: list[SourceFile], chunk_tokens: int) -> list[str]:
        """A repository's files as memory chunks, the corpora's chunker over the model's own tokenizer."""
        if self.repository_tokenizer is None:
            raise ApiError(422, "this model reads the needle vocabulary (stage 0's synthetic task), which has "
                                'no tokens for source files: send "chunks" instead of "files"', "files_unsupported",
                           "files")
        if chunk_tokens > self.max_chunk_tokens:
            raise ApiError(422, f"chunk_tokens {chunk_tokens}: this model's encoder reads chunks of at most "
                                f"{self.max_chunk_tokens} tokens", "chunk_too_long", "chunk_tokens")
        return [chunk.text for f in files for chunk in text_chunks(f.path, readable_text(f.path, f.text),
                                                                   self.repository_tokenizer, chunk_tokens)]

    @app.post("/v1/memories", status_code=201, response_model=None, responses=answers(
        {201: {"model": MemoryResponse, "description": "encoded now"},
         200: {"model": MemoryResponse, "description": "already held for this key (warm or on disk)"}},
        400, 409, 422))
    async def create_memory(self, body: MemoryRequest, who: Caller = Depends(caller)):
        chunks = body.chunks
        if body.files is not None:
            size = sum(len(f.text) for f in body.files)
            if size > MAX_CHARS_PER_TOKEN * self.max_memory_tokens:  # refused before any tokenizing
                raise ApiError(413, f"{size} characters of files: this server takes at most "
                                    f"{self.max_memory_tokens} tokens a memory", "memory_too_large", "files")
            chunks = await asyncio.to_thread(self._chunk_files, body.files, body.chunk_tokens)
            if not chunks:
                raise ApiError(422, "the files hold no text to remember", "empty_memory", "files")
        if len(chunks) > self.max_memory_chunks:
            raise ApiError(413, f"{len(chunks)} chunks: this server takes at most {self.max_memory_chunks} chunks "
                                f"and {self.max_memory_tokens} tokens a memory", "memory_too_large", "chunks")
        size = sum(len(c) for c in chunks)
        if size > MAX_CHARS_PER_TOKEN * self.max_memory_tokens:  # refused before any tokenizing
            raise ApiError(413, f"{size} characters of chunks: this server takes at most {self.max_memory_tokens} "
                                f"tokens a memory", "memory_too_large", "chunks")
        token_ids = self.pyfunc.chunk_token_ids(chunks)
        tokens = sum(len(c) for c in token_ids)
        if tokens > self.max_memory_tokens:
            raise ApiError(413, f"{tokens} tokens: this server takes at most {self.max_memory_tokens} tokens "
                                f"(and {self.max_memory_chunks} chunks) a memory", "memory_too_large", "chunks")
        if any(not c for c in token_ids):
            raise ApiError(422, "every chunk needs at least one token", "empty_chunk", "chunks")
        longest = max(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        if self.reads == "gca" and len(token_ids[longest]) > self.max_chunk_tokens:  # checked before encoding
            raise ApiError(413, f"chunk {longest} has {len(token_ids[longest])} tokens; this model's encoder reads "
                                f"at most {self.max_chunk_tokens} a chunk: split it", "chunk_too_long", "chunks")
        try:
            memory, how = await asyncio.to_thread(self.memories.create, who.owner, chunks, token_ids)
        except StoreMismatch:
            raise ApiError(409, "a memory of these chunks on this server was encoded by another encoder than this "
                                "model's", "encoder_mismatch") from None
        except OverDiskBudget as e:
            raise ApiError(413, f"{e}: delete memories you no longer need (DELETE /v1/memories/ID)",
                           "memory_disk_budget", "chunks") from None
        return JSONResponse(memory.describe() | {"source": how}, status_code=201 if how == "encoded" else 200)

    @app.get("/v1/memories/{id}", responses=answers({200: {"model": MemoryResponse}}, 404, 409))
    async def get_memory(self, id: str, who: Caller = Depends(caller)):
        memory, how = await asyncio.to_thread(self._memory, who.owner, id)
        return memory.describe() | {"source": how}

    @app.delete("/v1/memories/{id}", responses=answers({200: {"model": DeletedResponse}}, 404))
    async def delete_memory(self, id: str, who: Caller = Depends(caller)):
        if not ID.match(id):
            raise ApiError(404, f"no such memory (ids are 64 hex digits): {CREATE}", "memory_not_found")
        try:
            self.memories.delete(who.owner, id)
        except UnknownMemory:
            raise ApiError(404, f"no memory {id} for this key: {CREATE}", "memory_not_found") from None
        return {"id": id, "object": "memory", "deleted": True}

    @app.get("/v1/stats", responses=answers({200: {"description": "the replica's cache, batching and error counts"}},
                                            403))
    async def stats(self, who: Caller = Depends(admin_caller)):
        with self.memories.lock:
            held = {"memories": len(self.memories.entries),
                    "bytes": sum(m.nbytes for m in self.memories.entries.values())}
        return {"model": self.model_name, "budget_bytes": self.memories.budget_bytes, **held, **self.memories.counts,
                "batching": self.decoding.stats, "errors": dict(self.errors.counts)}

    @app.get("/v1/models", responses=answers({200: {"model": ModelList}}))
    async def models(self, who: Caller = Depends(caller)):
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{name:path}", responses=answers({200: {"model": ModelCard}}, 404))
    async def model(self, name: str, who: Caller = Depends(caller)):
        if name != self.model_name:
            raise ApiError(404, f"model {name!r} is not served here; GET /v1/models lists the one that is",
                           "model_not_found", "model")
        return self._model_card()

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "awareness",
                "reads": self.reads}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, who: Caller = Depends(caller)):
        if self.schema is None:  # app.openapi() needs every route: built on first use
            self.schema = served_schema(app.openapi(), model_name=self.model_name,
                                        max_tokens=self.max_tokens_limit, max_chunk_tokens=self.max_chunk_tokens,
                                        max_chunks=self.max_memory_chunks, files=self.repository_tokenizer is not None)
        return self.schema

    # ------------------------------------------------------------------------------------------------- questions
    def _prompt_ids(self, prompt: str, memory, index: int) -> list[int]:
        ids = self.pyfunc.tokenizer.encode(prompt).ids
        # whitespace alone (no tokens for the needle tokenizer; the schema's pattern for every model), or a <bos> alone
        if not NON_BLANK.search(prompt) or not self.pyfunc.tokenizer.encode(prompt, add_special_tokens=False).ids:
            raise ApiError(422, f"prompt {index} is empty (no tokens): send the question to answer", "empty_prompt",
                           "prompt")
        vocab = self.pyfunc.model.decoder.config.vocab_size
        if max(ids) >= vocab:
            raise ApiError(422, f"the prompt holds token ids >= the decoder's vocabulary ({vocab})", "bad_tokens",
                           "prompt")
        if self.reads != "gca":  # a baseline reads its memory in the prompt (all of it, its BM25 top-k, or none)
            ids = self.pyfunc.prompt_with_memory(ids, memory.chunk_ids if memory else [])
        positions = self.pyfunc.model.decoder.config.max_position_embeddings
        if len(ids) > positions:  # the answer may run past them (rotary positions extrapolate), the prompt may not
            raise ApiError(422, f"{len(ids)} prompt tokens{' with the memory' if self.reads != 'gca' else ''} "
                                f"exceed the decoder's {positions} positions", "prompt_too_long", "prompt")
        return ids

    @app.post("/v1/completions", responses=answers(
        {200: {"model": CompletionResponse, "content": SSE, "description": "a completion, or its server-sent events"}},
        400, 404, 409, 422, 504))
    async def completions(self, body: CompletionRequest, who: Caller = Depends(caller)):
        start = time.perf_counter()
        deadline = time.monotonic() + self.request_timeout_s
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"model {body.model!r} is not served here; GET /v1/models lists the one that is",
                           "model_not_found", "model")
        memory = (await asyncio.to_thread(self._memory, who.owner, body.memory))[0] if body.memory else None
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        prompt_ids = [self._prompt_ids(p, memory, i) for i, p in enumerate(prompts)]
        if body.max_tokens is not None and body.max_tokens > self.max_tokens_limit:
            raise ApiError(422, f"max_tokens {body.max_tokens}: this server writes at most {self.max_tokens_limit} "
                                f"tokens a completion (max_tokens_limit)", "invalid_request", "max_tokens")
        max_tokens = body.max_tokens or min(self.pyfunc.max_new_tokens, self.max_tokens_limit)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if body.stream:
            question = Question(prompt_ids[0], memory, max_tokens, body.temperature, body.top_p, body.seed, deadline)
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._stream(head, question, stops, usage, start), media_type="text/event-stream")
        asked = [Question(ids, memory, max_tokens, body.temperature, body.top_p,
                          None if body.seed is None else body.seed + j, deadline)
                 for ids in prompt_ids for j in range(body.n)]
        await self._answered(asked)
        choices, completion_tokens = [], 0
        for index, q in enumerate(asked):
            if q.error is not None:
                raise q.error
            if q.expired:
                raise ApiError(504, f"the request ran past this server's {self.request_timeout_s:g} s limit "
                                    f"(request_timeout_s): ask for fewer max_tokens", "timeout")
            text, reason = self._finish(q.tokens, stops, max_tokens)
            choices.append({"index": index, "text": text, "finish_reason": reason, "logprobs": None})
            completion_tokens += len(q.tokens)
            self._log(memory, len(q.ids), len(q.tokens), q.first, start)
        prompt_tokens = sum(len(ids) for ids in prompt_ids)
        return head | {"memory": memory.id if memory else None, "choices": choices,
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}}

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

    async def _stream(self, head: dict[str, Any], question: Question, stops: list[str], usage: bool, start: float):
        """The completion's server-sent events: its text as it grows, the finish reason, `usage` when asked, then
        [DONE]; an error event (and no [DONE]) when decoding fails or runs out of time. A client that leaves ends
        the question at the decoding loop's next step."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        question.on_token = lambda token: loop.call_soon_threadsafe(queue.put_nowait, token)
        question.on_done = lambda _: loop.call_soon_threadsafe(queue.put_nowait, None)

        def event(choice: dict[str, Any] | None, **more) -> str:
            data = head | {"choices": [] if choice is None else [{"index": 0, "logprobs": None} | choice]}
            return f"data: {json.dumps(data | ({'usage': None} if usage else {}) | more)}\n\n"

        self.decoding.submit(question)
        out, sent, ended = [], "", False
        try:
            while True:
                token = await queue.get()
                if token is None:
                    ended = True
                    break
                out.append(token)
                answer, finished = self._answer_ids(out)
                text = self.pyfunc.decode(answer)
                cut = min((text.index(s) for s in stops if s and s in text), default=None)
                if cut is not None:
                    text = text[:cut]
                if len(text) > len(sent) and text.startswith(sent):
                    yield event({"text": text[len(sent):], "finish_reason": None})
                    sent = text
                if cut is not None or finished:  # an answer cut at a stop string needs no more tokens
                    break
            question.cancel()
            if ended and question.error is not None:  # the client gets an error event, the log the traceback
                _count(500, "stream_failed")
                failed = error_body(500, f"decoding failed ({type(question.error).__name__}); the log says why",
                                    "stream_failed")
                yield f"data: {json.dumps(failed)}\n\n"
                return
            if ended and question.expired:
                _count(504, "timeout")
                message = (f"the request ran past this server's {self.request_timeout_s:g} s limit "
                           f"(request_timeout_s): ask for fewer max_tokens")
                yield f"data: {json.dumps(error_body(504, message, 'timeout'))}\n\n"
                return
            final, reason = self._finish(out, stops, question.max_tokens)
            if final.startswith(sent) and len(final) > len(sent):
                yield event({"text": final[len(sent):], "finish_reason": None})
            yield event({"text": "", "finish_reason": reason})
            if usage:
                yield event(None, usage={"prompt_tokens": len(question.ids), "completion_tokens": len(out),
                                         "total_tokens": len(question.ids) + len(out)})
            yield "data: [DONE]\n\n"
            self._log(question.memory, len(question.ids), len(out), question.first, start)
        finally:
            question.cancel()  # a client that left ends the question at the loop's next step

    def _log(self, memory, tokens_in: int, tokens_out: int, first: float | None, start: float) -> None:
        now = time.perf_counter()
        ttft = f"{(first - start) * 1000:.1f}" if first else "-"
        logger.info(f"completion memory={memory.id[:12] if memory else '-'} tokens_in={tokens_in} "
                    f"tokens_out={tokens_out} ttft_ms={ttft} latency_ms={(now - start) * 1000:.1f}")


def build(args: dict[str, Any]):
    """The application for `serve run` / `serve deploy` (import_path: pipelines.serving.app:build): `args` are
    AwarenessServer's keyword arguments (model, memory_dir, api_keys_file / api_keys_env, memory_budget_mb,
    max_memory_tokens, ...), and `max_ongoing_requests` / `max_queued_requests` the deployment's own (the config's
    `deployments:` section sets them too); the tracking server comes from `tracking_uri` or MLFLOW_TRACKING_URI."""
    args = dict(args)
    args.setdefault("tracking_uri", os.environ.get("MLFLOW_TRACKING_URI"))
    options = {k: int(args.pop(k)) for k in ("max_ongoing_requests", "max_queued_requests") if k in args}
    return (AwarenessServer.options(**options) if options else AwarenessServer).bind(**args)
