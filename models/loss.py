"""The causal-LM training loss without the full-vocabulary logits.

transformers' `ForCausalLMLoss` takes logits of shape (B, T, V) and upcasts them to fp32: for Qwen3's 151,936-token
vocabulary at 16k tokens a micro-batch that is ~10 GiB before its gradient. Here the LM head runs over the hidden
states a chunk of tokens at a time, each chunk checkpointed (its logits are recomputed in backward, never kept), so
at most one chunk's logits exist. On CUDA with Liger-Kernel installed, its fused linear cross-entropy does the same
in one kernel. Both equal transformers' loss: labels shifted left by one, IGNORE positions skipped, mean over the
labelled tokens.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # transformers' and torch's ignore_index
CHUNK_TOKENS = 2048  # tokens whose logits exist at once: 2,048 x 151,936 fp32 logits are 1.2 GiB


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the label each position predicts (the next token's), IGNORE after the last, as transformers
    shifts them."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def causal_lm_loss(hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor, *,
                   chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """transformers' causal-LM loss of `lm_head(hidden)` against `labels`, without the (B, T, V) logits.

    hidden: (B, T, H) the decoder's final (normed) states; labels: (B, T) with IGNORE_INDEX where no loss is taken.
    Packed rows need nothing more: their labels already hold IGNORE where an example starts."""
    targets = shift_labels(labels).reshape(-1)  # (B*T,)
    states = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H)
    keep = targets != IGNORE_INDEX
    count = keep.sum()
    if _liger_applies(states, lm_head):
        return _liger_loss(states, lm_head, targets)
    states, targets = states[keep], targets[keep]  # only labelled positions reach the LM head
    total = states.new_zeros((), dtype=torch.float32)
    for start in range(0, states.shape[0], chunk_tokens):
        piece = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_loss_sum, states[piece], targets[piece], lm_head, use_reentrant=False)
    # an all-IGNORE batch gives nan, as F.cross_entropy(reduction="mean") does
    return total / count


def _chunk_loss_sum(states: torch.Tensor, targets: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
    logits = lm_head(states).float()  # (chunk, V): the only logits alive, recomputed in backward
    return F.cross_entropy(logits, targets, reduction="sum")


def _liger_applies(states: torch.Tensor, lm_head: nn.Linear) -> bool:
    """Liger's fused kernel needs CUDA (Triton) and the whole LM-head weight: a ZeRO-3 partition (`ds_numel`) is
    gathered only inside lm_head's own forward, which the chunked path calls."""
    return (states.is_cuda and getattr(lm_head.weight, "ds_numel", None) is None and lm_head.bias is None
            and importlib.util.find_spec("liger_kernel") is not None)


def _liger_loss(states: torch.Tensor, lm_head: nn.Linear, targets: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # CUDA only: imported where it runs

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)(lm_head.weight, states, targets)
