"""Where the GCA blocks read: forward pre-hooks on the blocks record the attention over the memory their forward
computes (SDPA does not keep it), only while a probe is open, so the model itself carries no probe state. The
evaluation's memory-attention accuracy and training's attention entropy read it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from models import AwarenessModel


def gca_blocks(model: AwarenessModel) -> dict[int, nn.Module]:
    """The model's GCA blocks by layer, which the probes read; a model of another fusion is refused."""
    if model.fusion != "gca":
        raise ValueError(f"memory_attention probes GCA blocks; this model reads its memory with "
                         f"fusion={model.fusion!r}")
    return model.gca_blocks()


@contextmanager
def memory_attention_probe(blocks: Mapping[int, nn.Module], read: str = "memory_attention") -> Iterator[dict[int, Any]]:
    """While open, each forward of a GCA block in `blocks` (by layer) records what the block's method `read` gives for
    its input and memory, in the dict this yields (a later forward replaces an earlier one's): by default its
    attention over the memory tokens, (B_mem, H, r*T, M) float32 (routed: the unselected chunks at 0); `chunk_reading`:
    the router's chunk scores and full attention's chunk mass. The hooks are removed on leaving, whatever happened
    inside."""
    seen: dict[int, Any] = {}

    def recorder(layer: int):
        def record(block, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            memory = args[1] if len(args) > 1 else kwargs["memory"]
            seen[layer] = getattr(block, read)(hidden, memory)
        return record

    handles = [block.register_forward_pre_hook(recorder(i), with_kwargs=True) for i, block in blocks.items()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def mean_entropy(attention: torch.Tensor) -> torch.Tensor:
    """The mean entropy (nats) of attention distributions (..., M)."""
    return -(attention * attention.clamp_min(1e-12).log()).sum(-1).mean()


@torch.no_grad()
def memory_attention(model: AwarenessModel, **inputs: Any) -> list[torch.Tensor]:
    """Where each GCA layer reads when it predicts the token after each row: one forward over `inputs` (one memory
    row per prompt row) and, per GCA layer in layer order, the attention over the memory at the last position,
    (B, H, M) on the CPU."""
    with memory_attention_probe(gca_blocks(model)) as seen:
        model(**inputs)
    return [seen[i][:, :, -1].cpu() for i in sorted(seen)]  # (B_mem, H, r*T, M) -> (B, H, M)


@torch.no_grad()
def attention_entropy(model: AwarenessModel, **inputs: Any) -> dict[int, float]:
    """Per GCA layer, the mean entropy (nats) of its attention over the memory in one forward over `inputs`: it
    falls as the blocks learn to look up."""
    with memory_attention_probe(gca_blocks(model)) as seen:
        model(**inputs)
    return {i: float(mean_entropy(attention)) for i, attention in sorted(seen.items())}


@torch.no_grad()
def chunk_reading(model: AwarenessModel, **inputs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Where each GCA layer's routing sends the query that predicts the token after each row, and where full
    attention would: one forward over `inputs` (one memory row per prompt row, a routed model) and, per GCA layer in
    layer order, (the chunk scores its top-k are chosen by, full attention's mass per chunk) at the last position,
    each (B, H_kv, C) on the CPU (GatedCrossAttention.chunk_reading)."""
    with memory_attention_probe(gca_blocks(model), read="chunk_reading") as seen:
        model(**inputs)
    return [(scores[:, :, -1].cpu(), mass[:, :, -1].cpu()) for scores, mass in (seen[i] for i in sorted(seen))]
