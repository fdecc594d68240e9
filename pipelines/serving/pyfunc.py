"""The MLflow pyfunc model: question + memory chunk texts in, generated answer text out.

It holds only the small exported artifact (GCA, projection, LoRA); `load_context` rebuilds the model from the base
checkpoints that artifact names (`AwarenessModel.from_pretrained`), so no copy of the base weights is logged.
Text goes through the decoder checkpoint's own `tokenizer.json` (real Qwen3 checkpoints carry one; Qwen3-Embedding
shares its vocabulary, so memory chunks use it too). The random-weight pairs carry none: the registry writes one
beside the generated checkpoint, chosen by its vocabulary: Qwen3's (tiny-text, trained on corpus shards) gets the
corpora's offline Qwen3 tokenizer converted to tokenizer.json; the 512-id needle pairs get `needle_tokenizer()`, a
WordLevel tokenizer over stage 0's needle vocabulary, so a needle question is text too (`k117 =` -> `4 0 7`).
The question is a template (special-token strings in it are control tokens, as the corpus prompts' parts are);
memory chunks are plain text (special-token strings stay text, as the corpus builder encodes chunks).
Instead of chunk texts, a row may name a memory store (`memory_store`: a directory jobs/encode_memory.py wrote; or
`memory_store` in the model_config, for rows that give no memory): the model then reads the stored encoder states
and runs no encoder. A store made by another encoder is refused (pipelines.memory.store).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import torch
from mlflow.models import ModelSignature
from mlflow.types.schema import Array, ColSpec, DataType, ParamSchema, ParamSpec, Schema
from tokenizers import Tokenizer

from models import AwarenessModel
from models.quantization import check_quantize
from models.pairs import RANDOM_WEIGHTS_MARKER
from pipelines.data.memory_modes import prompt_memory, read_system, system_mode
from pipelines.data.needle_tokenizer import needle_tokenizer
from pipelines.format.tokenizer import VOCAB_SIZE, text_tokenizer, tokenizers_tokenizer
from pipelines.memory.store import MANIFEST, MemoryStore, encoder_identity, write

ENTRY = Path(__file__).with_name("pyfunc_entry.py")  # the file MLflow loads the model from (models from code)
TOKENIZER_FILE = "tokenizer.json"
# where the model is loaded: logged with every registered version, so a loader may override them (model_config=,
# MLFLOW_PYFUNC_INFERENCE_CONFIG); "auto": a GPU when there is one, the checkpoints' own dtype; quantize nf4 | int8:
# the frozen base weights in that many bits (models.quantization), what trained in full precision beside them
PLACEMENT = {"device": "auto", "dtype": "auto", "quantize": "none"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def placed_device(device: str = "auto") -> torch.device:
    """The device `placement` gives for this setting, whether or not this process sees it (a plan for another
    machine asks this)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r}: use auto, cpu, cuda or cuda:N") from None


def placement(device: str = "auto", dtype: str = "auto") -> tuple[torch.device, torch.dtype | None]:
    """The device and dtype a model is loaded with: device "auto" is the first GPU when this process sees one (a
    Serve replica with num_gpus: 1 sees exactly its own), else the CPU; dtype "auto" keeps the checkpoints' own."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use auto (the checkpoints' own) or one of {', '.join(DTYPES)}")
    where = placed_device(device)
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this process sees no GPU (give a Serve replica num_gpus: 1, or use cpu)")
    return where, DTYPES.get(dtype)


def ensure_tokenizer(decoder_dir: str | Path) -> Path:
    """The decoder checkpoint's tokenizer.json; for a random-weight checkpoint, one written there by its vocabulary
    size: the Qwen3 tokenizer when the vocabulary holds Qwen3's ids (and ours), else the needle tokenizer."""
    decoder_dir = Path(decoder_dir)
    path = decoder_dir / TOKENIZER_FILE
    if not path.is_file():
        if not (decoder_dir / RANDOM_WEIGHTS_MARKER).is_file():
            raise FileNotFoundError(
                f"{decoder_dir} has no {TOKENIZER_FILE}: the pyfunc model turns text into ids with the decoder "
                f"checkpoint's tokenizer; copy the checkpoint's tokenizer.json there"
            )
        vocab = json.loads((decoder_dir / "config.json").read_text())["vocab_size"]
        tokenizer = tokenizers_tokenizer() if vocab >= VOCAB_SIZE else needle_tokenizer()
        partial = path.with_suffix(f".{os.getpid()}.tmp")  # a concurrent loader never reads half a file
        tokenizer.save(str(partial))
        partial.replace(path)
    return path


class AwarenessPyfunc(mlflow.pyfunc.PythonModel):
    """predict(rows of {question: str, memory: list[str]} or {question: str, memory_store: str}) -> list of answers
    (greedy). The memory is read as the model was trained to read it (its export's system.json): through GCA, or, for
    a baseline, placed in its prompt (in_context: every chunk; rag: the top-k by BM25) or withheld (none)."""

    def load_context(self, context) -> None:
        self.export = context.artifacts["export"]
        self.mode = system_mode(read_system(self.export))
        settings = context.model_config or {}
        device, dtype = placement(str(settings.get("device", "auto")), str(settings.get("dtype", "auto")))
        quantize = check_quantize(str(settings.get("quantize", "none")))
        self.model = AwarenessModel.from_pretrained(self.export, device=device, dtype=dtype, quantize=quantize).eval()
        path = str(Path(self.model.config.decoder) / TOKENIZER_FILE)
        self.tokenizer = Tokenizer.from_file(path)  # the question: a template, special-token strings are tokens
        self.text_tokenizer = text_tokenizer(Tokenizer.from_file(path))  # memory chunks: every string is text
        self.max_new_tokens = int(settings.get("max_new_tokens", 32))
        eos = settings.get("eos_token")
        self.eos_token_id = self.tokenizer.token_to_id(eos) if eos else self.model.decoder.generation_config.eos_token_id
        self.pad_token_id = self.tokenizer.token_to_id(settings.get("pad_token") or "<pad>") or 0
        # False for corpus-trained models: their answers may be made of agentic tokens (<plan>, <read>, <edit>)
        self.skip_special_tokens = bool(settings.get("skip_special_tokens", True))
        self.memory_store = settings.get("memory_store")  # read by rows that give neither memory nor memory_store
        self.identity = None  # the encoder's identity, computed (hashing its files) when a store is first read
        self.stores: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[str]:
        max_new_tokens = int((params or {}).get("max_new_tokens") or self.max_new_tokens)
        answers = []
        for question, memory, store in _rows(model_input):
            store = store or (None if memory else self.memory_store)
            answers.append(self.answer(question, memory, max_new_tokens, store=store))
        return answers

    def encode(self, question: str, memory: list[str]) -> dict[str, torch.Tensor]:
        """Prompt ids (1, T); memory ids and mask (1, chunks, longest chunk), right-padded. A prompt-memory baseline:
        its memory tokens before the prompt, as training placed them (pipelines.data.memory_modes)."""
        question_ids = self.tokenizer.encode(question).ids
        prompt = torch.tensor([question_ids])
        chunks = self.chunk_token_ids(memory)
        if self.mode.kind != "gca":
            return {"input_ids": torch.tensor([self.prompt_with_memory(question_ids, chunks)])}
        if not chunks:
            return {"input_ids": prompt}
        width = max(len(c) for c in chunks)
        ids = torch.full((1, len(chunks), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((1, len(chunks), width), dtype=torch.long)
        for i, chunk in enumerate(chunks):
            ids[0, i, : len(chunk)], mask[0, i, : len(chunk)] = torch.tensor(chunk), 1
        return {"input_ids": prompt, "memory_input_ids": ids, "memory_attention_mask": mask}

    def prompt_with_memory(self, question_ids: list[int], chunk_ids: list[list[int]]) -> list[int]:
        """A prompt-memory baseline's prompt: the memory's tokens (all of it, its BM25 top-k, or none) before the
        question's."""
        return prompt_memory(chunk_ids, question_ids, self.mode) + question_ids

    def encoder_identity(self):
        """The identity of this model's encoder (pipelines.memory.store), computed once (it hashes the files)."""
        if self.identity is None:
            self.identity = encoder_identity(self.export, dtype=self.model.memory_encoder.encoder.dtype)
        return self.identity

    @torch.no_grad()
    def encode_chunk_ids(self, chunks: list[list[int]]) -> list[torch.Tensor]:
        """Each chunk (its token ids) alone through the model's encoder (as jobs/encode_memory.py does): its
        unpadded states (tokens, H_enc), on the CPU."""
        width = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), 1, width), self.pad_token_id, dtype=torch.long)  # (C, 1, L_max): one a row
        mask = torch.zeros_like(ids)
        for i, chunk in enumerate(chunks):
            ids[i, 0, : len(chunk)], mask[i, 0, : len(chunk)] = torch.tensor(chunk), 1
        states, _ = self.model.encode_memory(ids.to(self.model.device), mask.to(self.model.device))
        return [states[i, : len(c)].cpu() for i, c in enumerate(chunks)]

    def chunk_token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each chunk text's token ids, as the encoder reads them."""
        return [self.text_tokenizer.encode(t, add_special_tokens=False).ids for t in texts]

    def write_store(self, directory: str | Path, texts: list[str], **about: Any) -> dict[str, Any]:
        """These chunk texts encoded once into a memory store at `directory` (what a row's `memory_store` names).
        Returns its manifest."""
        chunk_ids = self.chunk_token_ids(texts)
        return write(directory, [("memory", i, t) for i, t in enumerate(texts)], self.encode_chunk_ids(chunk_ids),
                     chunk_ids, self.encoder_identity(), **about)

    def store_inputs(self, store: MemoryStore) -> dict[str, torch.Tensor]:
        """A store as this model's memory inputs: its states (chunked for a routing model) and, for lexical
        routing, its chunks' token ids."""
        routed = self.model.reading.routes
        states, mask = store.memory(device=self.model.device, chunked=routed)
        inputs = {"memory_states": states, "memory_states_mask": mask}
        if routed and self.model.reading.lexical_routing:
            inputs["memory_chunk_ids"] = store.token_ids(device=self.model.device)
        return inputs

    def stored_memory(self, directory: str) -> dict[str, torch.Tensor]:
        """A store's states as memory_states/memory_states_mask, checked against this model's encoder; the last store
        read is kept (until its manifest changes), so a run of questions over one repository reads it once."""
        self.encoder_identity()
        manifest = Path(directory) / MANIFEST
        key = (str(Path(directory).resolve()), manifest.stat().st_mtime_ns if manifest.is_file() else 0)
        if key not in self.stores:
            store = MemoryStore(directory)
            store.check(self.identity)
            self.stores = {key: self.store_inputs(store)}
        return self.stores[key]

    def answer(self, question: str, memory: list[str], max_new_tokens: int, store: str | None = None) -> str:
        if store and memory:
            raise ValueError("a row gives either memory (chunk texts) or memory_store (a store directory), not both")
        if store and self.mode.kind != "gca":
            raise ValueError(f"this model reads its memory as {self.mode.kind}, not through an encoder: give the "
                             f"memory's chunk texts (`memory`), not a memory_store")
        inputs = self.encode(question, memory) if not store else {
            "input_ids": self.encode(question, [])["input_ids"], **self.stored_memory(store)}
        inputs = {name: tensor.to(self.model.device) for name, tensor in inputs.items()}  # a GPU-placed model
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        return self.decode(out[0, inputs["input_ids"].shape[1]:].tolist())

    def decode(self, ids: list[int]) -> str:
        """The answer's text: its ids up to the first end-of-answer token."""
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        end = next((i for i, token in enumerate(ids) if token in eos), len(ids))
        return self.tokenizer.decode(ids[:end], skip_special_tokens=self.skip_special_tokens)


def _rows(model_input) -> list[tuple[str, list[str], str | None]]:
    """(question, memory texts, memory store) from a DataFrame with columns question and memory or memory_store, a
    dict, or a list of dicts."""
    if hasattr(model_input, "to_dict"):
        model_input = model_input.to_dict(orient="records")
    if isinstance(model_input, dict):
        model_input = [model_input]
    rows = []
    for row in model_input:
        if "question" not in row:
            raise ValueError(f"each input needs a 'question' (text) and a 'memory' (list of chunk texts) or a "
                             f"'memory_store' (a directory written by jobs/encode_memory.py); got {sorted(row)}")
        memory, store = row.get("memory"), row.get("memory_store")
        memory = [] if memory is None or isinstance(memory, float) else [str(m) for m in memory]  # float: a NaN cell
        store = store if isinstance(store, str) and store else None
        rows.append((str(row["question"]), memory, store))
    return rows


def signature():
    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string, "question"), ColSpec(Array(DataType.string), "memory", required=False),
                       ColSpec(DataType.string, "memory_store", required=False)]),
        outputs=Schema([ColSpec(DataType.string)]),
        params=ParamSchema([ParamSpec("max_new_tokens", DataType.long, 0)]),
    )
