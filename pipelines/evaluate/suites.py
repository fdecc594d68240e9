"""What one evaluation worker does with one loaded model: answer RULER-style needle probes as its system (gca,
in_context, rag or none) and score them, and time it against memory size. jobs/evaluate.py runs these inside Ray
Data actors (pipelines.evaluate.job); they take no Ray themselves, so a test can call them directly.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch

from models import AwarenessModel
from pipelines.data import memory_store
from pipelines.data.memory_modes import MemoryMode, prompt_memory, top_chunks
from pipelines.data.synthetic_needles import EOS, FILLER, PAD, NeedleSpec
from pipelines.evaluate.metrics import evidence_reading, string_match_all
from pipelines.evaluate.ruler import Probe, as_text, make_probe


@dataclass(frozen=True)
class System:
    """A loaded model and how it reads its memory; `name` labels it in results.json. `served`: the registered
    version's pyfunc (mlflow.pyfunc.load_model), which then answers instead, text in and text out, as users get it.
    `export`: the directory the model was loaded from (its encoder's identity, for the memory store gca reads)."""

    name: str
    model: AwarenessModel | None
    mode: MemoryMode
    spec: NeedleSpec
    served: Any = None
    export: str | None = None


# ---------------------------------------------------------------------------------------------- needles
def system_prompts(probe: Probe, mode: MemoryMode) -> dict[str, torch.Tensor]:
    """One row per question, as the system sees it: the question alone (gca, none), after the whole memory
    (in_context) or after its top-k chunks (rag); gca rows carry the memory for the encoder."""
    chunks = probe.memory.tolist()
    rows = [prompt_memory(chunks, question, mode) + question for question in probe.questions]
    inputs = {"input_ids": torch.tensor(rows)}  # a probe's rows have equal lengths (its questions do)
    if mode.kind == "gca":
        inputs["memory_input_ids"] = torch.from_numpy(probe.memory)[None].expand(len(rows), -1, -1)
    return inputs


def served_answers(system: System, probe: Probe) -> list[list[int]]:
    """The registered pyfunc's answers to the probe as text (the needle vocabulary's words: `k117`, digits, `w300`),
    read back into ids through the same tokenizer."""
    from pipelines.tracking.pyfunc import needle_tokenizer

    tokenizer = needle_tokenizer()
    words = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    memory = [words(chunk) for chunk in probe.memory.tolist()]
    rows = [{"question": words(question[1:]), "memory": memory} for question in probe.questions]  # BOS: the tokenizer's
    new = max(sum(len(r) for r in refs) for refs in probe.references) + 1
    answers = system.served.predict(rows, params={"max_new_tokens": new})
    return [tokenizer.encode(answer, add_special_tokens=False).ids for answer in answers]


@torch.no_grad()
def answer_probe(system: System, probe: Probe) -> list[list[int]]:
    """Greedy answers, each cut at EOS: long enough for every reference of the question plus EOS."""
    if system.served is not None:
        return served_answers(system, probe)
    inputs = {k: v.to(system.model.device) for k, v in system_prompts(probe, system.mode).items()}
    new = max(sum(len(r) for r in refs) for refs in probe.references) + 1
    out = system.model.generate(**inputs, max_new_tokens=new, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    answers = []
    for row in out[:, inputs["input_ids"].shape[1] :].tolist():
        answers.append(row[: row.index(EOS)] if EOS in row else row)
    return answers


def score_probe(system: System, variant: str, multiplier: int, seed: int, index: int, hops: int = 2,
                depth_bins: int = 4) -> list[dict[str, Any]]:
    """One row per question: RULER's string_match_all (share of its references found, whole tokens), exact (all
    found), the depth bin of the fact holding the answer, and for gca where its attention went."""
    probe = make_probe(variant, system.spec, multiplier, seed, index, hops=hops)
    answers = answer_probe(system, probe)
    read_attention = system.mode.kind == "gca" and system.served is None  # a pyfunc does not show its attention
    reading = memory_attention(system, probe) if read_attention else [{}] * len(answers)
    rows = []
    for answer, refs, depth, read in zip(answers, probe.references, probe.depth, reading, strict=True):
        score = string_match_all([as_text(answer)], [[as_text(ref) for ref in refs]])
        rows.append({"system": system.name, "variant": variant if variant != "variable_tracking" else f"{variant}_{hops}",
                     "multiplier": multiplier, "memory_tokens": probe.memory.size, "index": index,
                     "score": score, "exact": score == 1.0, "depth_bin": min(int(depth * depth_bins), depth_bins - 1),
                     "evidence_mass": read.get("evidence_mass", float("nan")),
                     "top_chunk": read.get("top_chunk", float("nan"))})
    return rows


@torch.no_grad()
def memory_attention(system: System, probe: Probe) -> list[dict[str, float]]:
    """Memory-attention accuracy: at the question's last token (which predicts the first answer token), the share of
    GCA attention mass on the evidence chunks and whether the chunk read most is one of them, in the GCA layer that
    puts the most mass on the evidence (metrics.evidence_reading)."""
    inputs = {k: v.to(system.model.device) for k, v in system_prompts(probe, system.mode).items()}
    maps = system.model.memory_attention(**inputs)  # per layer (questions, heads, M)
    length = probe.memory.shape[1]
    chunks = [(c * length, (c + 1) * length) for c in range(probe.memory.shape[0])]
    out = []
    for q, evidence in enumerate(probe.evidence):
        mass, top = evidence_reading([m[q] for m in maps], chunks, evidence)
        out.append({"evidence_mass": mass, "top_chunk": float(top)})
    return out


# ---------------------------------------------------------------------------------------------- efficiency
class PeakRss:
    """Peak resident memory of this process while the block runs, sampled every millisecond (CPU runs; on a GPU the
    caller reads torch.cuda.max_memory_allocated instead)."""

    def __enter__(self):
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def grown_mib(self) -> float:
        return (self.peak - self.start) / 2**20


def filler_memory(tokens: int, chunk_len: int, seed: int = 0) -> np.ndarray:
    """A memory of `tokens` filler tokens in chunks of chunk_len (what it says does not change the cost)."""
    rng = np.random.default_rng(seed)
    return rng.choice(np.array(FILLER), size=(max(tokens // chunk_len, 1), chunk_len))


def _timed(fn, repeats: int) -> tuple[float, Any]:
    """Median seconds of `repeats` calls after one warm-up call, and the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result


@torch.no_grad()
def efficiency_row(system: System, memory_tokens: int, *, decode_tokens: int = 16, repeats: int = 3) -> dict[str, Any]:
    """Time to first token, per-token decode and peak memory for one question over a memory of `memory_tokens`.
    gca reads a memory store encoded once and written to disk (pipelines.data.memory_store, in this process's temp
    dir): its first token pays loading the store, the projection and the prefill of the question, and the encoding is
    reported apart (`encode_s`); in_context pays the prefill of the whole memory, rag its retrieval and the prefill of
    its k chunks, none only the question."""
    model, mode, device = system.model, system.mode, system.model.device
    memory = filler_memory(memory_tokens, system.spec.chunk_len)
    question = [1, 100]  # BOS key
    row: dict[str, Any] = {"system": system.name, "memory_tokens": int(memory.size)}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRss() as rss, tempfile.TemporaryDirectory(prefix="memory-store-") as store:
        if mode.kind == "gca":
            row["encode_s"], identity = write_filler_store(system, memory, store)

            def first_token():
                states, mask = memory_store.read(store, identity, device=device)
                gca_memory = model.prepare_memory(memory_states=states, memory_states_mask=mask)
                logits = model(input_ids=prompt, gca_memory=gca_memory).logits
                return logits[:, -1].argmax(-1)

            prompt = torch.tensor([question], device=device)
            states, mask = memory_store.read(store, identity, device=device)
            generate_kwargs = {"memory_states": states, "memory_states_mask": mask}
        else:
            def first_token():
                prefix = prompt_memory(memory.tolist(), question, mode)
                ids = torch.tensor([prefix + question], device=device)
                return model(input_ids=ids).logits[:, -1].argmax(-1)

            prompt = torch.tensor([prompt_memory(memory.tolist(), question, mode) + question], device=device)
            generate_kwargs = {}
        row["ttft_s"], _ = _timed(first_token, repeats)
        settings = {"do_sample": False, "eos_token_id": None, "pad_token_id": PAD}
        one, _ = _timed(lambda: model.generate(prompt, max_new_tokens=1, **settings, **generate_kwargs), 1)
        many, _ = _timed(lambda: model.generate(prompt, max_new_tokens=decode_tokens, **settings, **generate_kwargs), 1)
        row["decode_s_per_token"] = max(many - one, 0.0) / (decode_tokens - 1)
    row["prompt_tokens"] = int(prompt.shape[1])
    row["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else rss.grown_mib
    row["peak_kind"] = "cuda_max_allocated" if cuda else "rss_growth"
    return row


def write_filler_store(system: System, memory: np.ndarray, directory: str) -> tuple[float, memory_store.EncoderIdentity]:
    """Encodes the memory's chunks (C, L) with the system's encoder and writes them as a store; returns the encoding
    seconds (one timed call after a warm-up) and the export's encoder identity, which the store carries and a reader
    is checked against."""
    if system.export is None:
        raise ValueError(f"{system.name}: gca's efficiency reads a memory store, which names the export's encoder; "
                         f"load the system from its export (pipelines.evaluate.job.load_system)")
    ids = torch.from_numpy(memory)[None].to(system.model.device)  # (1, C, L)
    seconds, (states, _) = _timed(lambda: system.model.encode_memory(ids), 1)  # (1, C*L, H_enc)
    identity = memory_store.encoder_identity(system.export, dtype=system.model.memory_encoder.encoder.dtype)
    chunks = [("filler", i, "") for i in range(memory.shape[0])]
    memory_store.write(directory, chunks, states[0].split(memory.shape[1]), identity)
    return seconds, identity


@torch.no_grad()
def encoder_throughput(system: System, chunks: int = 256, batch: int = 64) -> float:
    """Memory chunks the encoder turns into states per second (the cost a memory store pays once)."""
    memory = torch.from_numpy(filler_memory(chunks * system.spec.chunk_len, system.spec.chunk_len))
    memory = memory.view(-1, 1, system.spec.chunk_len).to(system.model.device)  # one chunk per row

    def encode_all():
        for start in range(0, chunks, batch):
            system.model.encode_memory(memory[start : start + batch])

    seconds, _ = _timed(encode_all, 1)
    return chunks / seconds


def rag_retrieval_s(system: System, memory_tokens: int) -> float:
    """BM25 index + query over the memory's chunks: rag's cost before its prefill (included in its ttft)."""
    chunks = filler_memory(memory_tokens, system.spec.chunk_len).tolist()
    seconds, _ = _timed(lambda: top_chunks(chunks, [1, 100], system.mode.rag_k), 1)
    return seconds
