"""The efficiency suite: time to first token, per-token decode, peak memory and (gca) encoder throughput against
memory size, for each system as it reads its memory (gca from a memory store, in_context the whole memory in its
prompt, rag its retrieved chunks, none nothing).

One actor per system measures every memory size in one batch, so timings never share a device with another
measurement. `efficiency_row` and its helpers take no Ray, so a test calls them directly.
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
import psutil
import torch

from pipelines.data.batch_inference import items_dataset, map_with_actors
from pipelines.data.memory_modes import prompt_memory, top_chunks
from pipelines.data.synthetic_needles import FILLER, PAD
from pipelines.evaluate.common import Source, SuiteResult, System, Workers, load_system
from pipelines.memory import store as memory_store


@dataclass
class EfficiencySuite:
    memory_tokens: list[int] = field(default_factory=lambda: [1024, 4096, 16384])  # 65536 too on a GPU
    decode_tokens: int = 16  # tokens generated to time decoding
    repeats: int = 3  # timed calls per point (median), after one warm-up
    encoder_chunks: int = 256  # chunks encoded to time the encoder


# ---------------------------------------------------------------------------------------------- measurements
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
    gca reads a memory store encoded once and written to disk (pipelines.memory.store, in this process's temp
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
            chunked = model.reading.routes  # a routing model reads the store's chunks as chunks

            def stored() -> dict[str, torch.Tensor]:
                states, mask = memory_store.read(store, identity, device=device, chunked=chunked)
                inputs = {"memory_states": states, "memory_states_mask": mask}
                if chunked and model.reading.lexical_routing:  # the question's prior compares the chunks' ids
                    inputs["memory_chunk_ids"] = memory_store.MemoryStore(store).token_ids(device=device)
                return inputs

            def first_token():
                gca_memory = model.prepare_memory(**stored())
                logits = model(input_ids=prompt, gca_memory=gca_memory).logits
                return logits[:, -1].argmax(-1)

            prompt = torch.tensor([question], device=device)
            generate_kwargs = stored()
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


def write_filler_store(system: System, memory: np.ndarray,
                       directory: str) -> tuple[float, memory_store.EncoderIdentity]:
    """Encodes the memory's chunks (C, L) with the system's encoder and writes them as a store; returns the encoding
    seconds (one timed call after a warm-up) and the export's encoder identity, which the store carries and a reader
    is checked against."""
    if system.export is None:
        raise ValueError(f"{system.name}: gca's efficiency reads a memory store, which names the export's encoder; "
                         f"load the system from its export (pipelines.evaluate.common.load_system)")
    ids = torch.from_numpy(memory)[None].to(system.model.device)  # (1, C, L)
    seconds, (states, _) = _timed(lambda: system.model.encode_memory(ids), 1)  # (1, C*L, H_enc)
    identity = memory_store.encoder_identity(system.export, dtype=system.model.memory_encoder.encoder.dtype)
    chunks = [("filler", i, "") for i in range(memory.shape[0])]
    memory_store.write(directory, chunks, states[0].split(memory.shape[1]), memory.tolist(), identity)
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


# ---------------------------------------------------------------------------------------------- the suite
class EfficiencyMeter:
    """A Ray Data actor: loads one system, measures it at every memory size of its batch."""

    def __init__(self, name: str, export: str, system: dict[str, Any], settings: dict[str, Any], use_gpu: bool):
        self.system = load_system(name, export, system, "cuda" if use_gpu else "cpu")
        self.settings = settings

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        s = self.settings
        rows = []
        for tokens in batch["memory_tokens"]:
            row = efficiency_row(self.system, int(tokens), decode_tokens=s["decode_tokens"], repeats=s["repeats"])
            row["retrieval_s"] = rag_retrieval_s(self.system, int(tokens)) if self.system.mode.kind == "rag" else 0.0
            row["encoder_chunks_per_s"] = (encoder_throughput(self.system, s["encoder_chunks"])
                                           if self.system.mode.kind == "gca" else 0.0)
            row["encode_s"] = row.get("encode_s", 0.0)
            rows.append(row)
        return {key: [row[key] for row in rows] for key in rows[0]}


def run_efficiency(settings: EfficiencySuite, source: Source, workers: Workers) -> list[dict[str, Any]]:
    """One actor measures every memory size in one batch, so no two timings share a device."""
    measured = map_with_actors(
        items_dataset([{"memory_tokens": n} for n in settings.memory_tokens], per_block=None),
        EfficiencyMeter, actors=1, batch_size=len(settings.memory_tokens),
        cpus_per_actor=workers.cpus_per_actor, use_gpu=workers.use_gpu,
        constructor_kwargs={"name": source.name, "export": source.export, "system": source.system,
                            "settings": asdict(settings), "use_gpu": workers.use_gpu})
    return sorted(measured.take_all(), key=lambda row: row["memory_tokens"])


def efficiency_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    metrics = {}
    for row in rows:
        n = int(row["memory_tokens"])
        for key in ("ttft_s", "decode_s_per_token", "peak_mib", "encode_s", "retrieval_s"):
            metrics[f"efficiency/{key}/{n}"] = float(row[key])
    speeds = [float(r["encoder_chunks_per_s"]) for r in rows if r["encoder_chunks_per_s"]]
    if speeds:
        metrics["efficiency/encoder_chunks_per_s"] = max(speeds)
    return metrics


class EfficiencyEvaluation:
    """The suite for every system: its measurements (results.json's `efficiency` section) and their metrics."""

    name: ClassVar[str] = "efficiency"

    def __init__(self, settings: EfficiencySuite, workers: Workers):
        self.settings, self.workers = settings, workers

    def run(self, source: Source) -> SuiteResult:
        rows = run_efficiency(self.settings, source, self.workers)
        line = f"{source.name}: ttft " + "  ".join(f"{r['memory_tokens']}: {r['ttft_s'] * 1000:.1f} ms" for r in rows)
        return SuiteResult(efficiency_metrics(rows), {}, {"efficiency": rows}, line)

    def close(self) -> None:
        pass
