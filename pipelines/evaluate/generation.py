"""Memory-conditioned generation: the same prompt answered with different memories, and without one."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from models import AwarenessModel


@dataclass
class GenerationReport:
    with_memory: list[list[int]]  # one continuation per memory
    without_memory: list[int]
    seconds: float
    new_tokens: int
    logit_change: float  # max |next-token logits with a memory - without|: exactly 0 while the gates are closed

    def summary(self) -> dict[str, Any]:
        return {
            "memory_changes_output": len({tuple(c) for c in self.with_memory}) > 1,
            "matches_no_memory": all(c == self.without_memory for c in self.with_memory),
            "max_logit_change": self.logit_change,
            "tokens_per_s": round(self.new_tokens / self.seconds, 1),
        }


@torch.no_grad()
def generate_with_memories(
    model: AwarenessModel,
    prompt: torch.Tensor,
    memories: torch.Tensor,
    memory_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 16,
    num_beams: int = 1,
) -> GenerationReport:
    """prompt (T,), memories (N, chunks, chunk_len): one batched generate over the N memories, and one without."""
    model.eval()
    n = memories.shape[0]
    prompts = prompt.expand(n, -1).to(model.device)
    settings = dict(max_new_tokens=max_new_tokens, num_beams=num_beams, do_sample=False, eos_token_id=None,
                    pad_token_id=0)
    start = time.perf_counter()
    out = model.generate(prompts, memory_input_ids=memories.to(model.device),
                         memory_attention_mask=None if memory_mask is None else memory_mask.to(model.device),
                         **settings)
    bare = model.generate(prompts[:1], **settings)
    seconds = time.perf_counter() - start
    with_logits = model(input_ids=prompts, memory_input_ids=memories.to(model.device),
                        memory_attention_mask=None if memory_mask is None else memory_mask.to(model.device)).logits
    bare_logits = model(input_ids=prompts).logits  # at batch N too: a CPU matmul rounds batches of 1 and N apart
    t = prompt.shape[-1]
    return GenerationReport(
        with_memory=out[:, t:].tolist(), without_memory=bare[0, t:].tolist(), seconds=seconds,
        new_tokens=(n + 1) * max_new_tokens,
        logit_change=float((with_logits[:, -1] - bare_logits[:, -1]).abs().max()),
    )
