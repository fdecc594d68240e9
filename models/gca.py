"""Gated cross-attention (GCA): a pretrained decoder layer reads the encoder memory.

Design (after Flamingo, Mllama and torchtune's `FusionLayer`/`TanhGate`):

* The block sits *before* the wrapped transformers decoder layer, so the layer's own forward runs untouched (no
  second copy of Qwen3) and its self-attention and MLP process what the block wrote into the stream.
* Pre-norm on the decoder stream, queries from the decoder, keys/values from the memory, the decoder's GQA layout and
  QK-norm, no RoPE on memory keys (the memory is a set of chunks, each prefixed with its path), SDPA.
* The update is scaled by `tanh(gate)`, gate at 0: at initialisation the model is exactly the pretrained decoder.
* The gated MLP after the cross-attention (Flamingo/Mllama) is optional and off by default: the wrapped layer's MLP
  follows at once, and the extra one adds 3·d·d_ff parameters per block.

**Chunk-routed attention** (`MemoryReading.top_k` > 0; GCA blocks and the `cross` fusion, through `attend_memory`).
The memory is C chunks of L tokens; read in full, a query's softmax mass on the right chunk is diluted by every other
chunk as the memory grows. Routing keeps each query's top-k chunks and attends to their tokens only:

* **Selection, then exact attention over the union**: with k >= C it *is* full attention, whatever the weights, and
  within the kept chunks the token attention is the trained one. Unlike Grouped Cross Attention (Hu et al. 2024) or
  Landmark Attention, the attention itself is unchanged, so a model trained without routing reads alike at any k.
* **Summary key**: `ChunkRouter` (Linear + RMSNorm per kv head) of the projected state of each chunk's last real
  token: the causal encoder's only token that saw the whole chunk (what Qwen3-Embedding pools), where a mean would
  dilute a single needle by 1/L. Not the block's own k_proj, which the routing loss would then pull.
* **Several summaries a chunk** (`summaries` = S): one key per block of L / S tokens, a chunk scoring its best block,
  since one vector cannot hold every key of a chunk full of similar facts; C * S scores a step, still far below C * L.
* **Training signal**: KL(full attention's chunk mass || router) per query and kv head, the teacher without
  gradient, queries and summarised states detached: it trains the router only, and the answer path is what it would
  be unrouted. Computed in training, where memories are short (also at k >= C: the router learns at 1x what it must do
  at 64x).
* **Router chunk weights** (`chunk_weights="router"`): Grouped Cross Attention's fusion: a softmax inside each chosen
  chunk, the k outputs mixed by the softmax of their router scores, with gradients, so the answer loss trains the
  router too. It reads differently from full attention at any k < C.
* **GQA**: one selection per kv head (its query heads' mean query), so the group shares one gathered key/value set.
* **Lexical gate** (`lexical_gate`): the question's prior (models/lexical.py) is scaled per query token by a learned
  2 sigmoid(w x + b), 1 at initialisation, so a token that no longer asks the question (the key a two_hop answer
  names before reading it) can turn the prior down rather than be held to the question's chunk by it.
* **Token prior** (`lexical_tokens`): each query also scores up the chunks holding the token it reads
  (`GCAMemory.hold_tokens`, once per forward or decoding step), so the key an answer names is read next; with the gate,
  its own gate output.
* **The answer's window** (`lexical_window`, `lexical_reading_window`): an answer token's token prior is the largest
  of its answer's last W tokens' (models/lexical.py), so a named key's chunk stays read while its value is written;
  `GCAMemory.answer` says which tokens answer (AwarenessModel sets it from the labels, generate's rows or the
  memory's earlier calls; the Serve loop from each row's answer). `lexical_window_carry` < 1 weighs the earlier
  tokens' priors down, so the chunk the token itself names still wins where the answer moves on to another value.
* **Padding**: a chunk with nothing the query may read scores -inf; a row with no memory reads nothing.
* **Cost**: summary keys are computed once per forward or generation. Few queries (a decoding step) gather their k
  chunks (`gathered`: O(Q * k * L)); long query blocks attend over the whole memory with the unchosen chunks masked
  (`masked`: O(Q * M), no per-query copies). Both give the same result; `ChunkRouting.path` "auto" picks by cost.

**Length-aware scale** (`logn_scale` = n_train > 0): queries times max(1, log n / log n_train), n the real memory
tokens a query reads (Qwen's logn scaling; Scalable-Softmax with s fixed at 1 / log n_train): no training, and the
identity up to the trained length, so a model trained at 1x is unchanged there and sharpens only beyond it.

Measurements behind these choices: docs/results/2026-11-27-code-comment-measurements.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
# norms and the MLP are looked up in transformers' module when a block is built, so kernels patched in there
# (models/kernels.py, Liger-Kernel) reach the GCA blocks too
from transformers.models.qwen3 import modeling_qwen3

from models.lexical import NO_TOKEN, TokenIndex, answer_windows


@dataclass
class MemoryKV:
    """One GCA layer's keys and values over the memory, computed once per forward or generation."""

    key: torch.Tensor  # (B_mem, n_kv_heads, M, head_dim)
    value: torch.Tensor  # (B_mem, n_kv_heads, M, head_dim)
    padding: "MemoryPadding"
    routing: "ChunkRouting | None" = None  # chunk-routed attention (memory_top_k > 0); None: full attention
    logn_base: int = 0  # n_train of the length-aware scale (memory_logn_scale); 0: off


@dataclass
class ChunkRouting:
    """What routing needs besides keys and values: the memory's chunk length, one summary key per chunk and kv head,
    which chunks a query may read, and k. `loss` is written by attend_memory when `train` (the auxiliary routing
    loss of this layer and forward)."""

    summary: torch.Tensor  # (B_mem, n_kv_heads, C * S, head_dim), from ChunkRouter: S summary keys per chunk
    chunk_len: int  # L: the memory is C chunks of L positions, M = C * L
    top_k: int
    chunk_mask: torch.Tensor | None  # (B_mem, 1, 1 or T, C) bool: the chunk holds a token the query may read
    summaries: int = 1  # S: summary keys per chunk, one per block of L / S tokens; a chunk scores its best block's
    summary_mask: torch.Tensor | None = None  # (B_mem, 1, 1 or T, C * S) bool, when S > 1: the block holds one
    train: bool = False  # compute the routing loss (training)
    # How the chosen chunks are attended: gathered (each query's k chunks copied out) or masked (the whole memory, the
    # rest masked), the same result at different costs; auto picks the cheaper. A caller that prepared the memory may
    # set it on each layer's routing (benchmarks/routed_training.py compares the two)
    path: str = "auto"
    weights: str = "attention"  # attention: one softmax over the chosen chunks' tokens | router: GCA's fusion
    prior: torch.Tensor | None = None  # (B_mem, 1 or R, C) float32: added to the chunk scores (models/lexical.py)
    # (B_mem, Q, C) float32, per folded query of the current forward: the token prior (GCAMemory.hold_tokens)
    token_prior: torch.Tensor | None = None
    loss: torch.Tensor | None = None

    @property
    def num_chunks(self) -> int:
        return self.summary.shape[2] // self.summaries

    @property
    def selects(self) -> bool:
        """False when k keeps every chunk: attention is then exactly full attention."""
        return self.top_k < self.num_chunks


@dataclass
class MemoryPadding:
    """The memory's padding in the form attention needs it, derived once and shared by every GCA layer."""

    # (B_mem, 1, 1 or T, M) bool, True = attend; None when nothing is padded (fastest SDPA)
    attn_mask: torch.Tensor | None
    has_memory: torch.Tensor | None  # (B_mem, 1, 1 or T, 1) 0/1; None when every row has at least one real token

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "MemoryPadding":
        """mask (B_mem, M) bool. A row whose memory is all padding attends to its (zeroed) states and then has its
        output dropped, instead of producing NaN from an empty softmax."""
        if bool(mask.all()):
            return cls(attn_mask=None, has_memory=None)
        has_memory = mask.any(dim=-1)  # (B_mem,)
        attn_mask = (mask | ~has_memory[:, None])[:, None, None, :]
        return cls(attn_mask=attn_mask, has_memory=None if bool(has_memory.all()) else has_memory[:, None, None, None])

    @classmethod
    def packed(cls, mask: torch.Tensor, memory_segments: torch.Tensor, query_segments: torch.Tensor) -> "MemoryPadding":
        """Several examples packed into one row: a query token reads only its own example's memory.
        mask, memory_segments (B, M); query_segments (B, T); segment ids < 0 belong to no example (padding)."""
        allowed = query_segments[:, :, None] == memory_segments[:, None, :]  # (B, T, M)
        allowed &= mask[:, None, :] & (query_segments >= 0)[:, :, None]
        has_memory = allowed.any(dim=-1)  # (B, T)
        attn_mask = (allowed | ~has_memory[..., None])[:, None]  # (B, 1, T, M)
        return cls(attn_mask=attn_mask, has_memory=has_memory[:, None, :, None])


class GatedCrossAttention(GradientCheckpointingLayer):
    """`x + tanh(gate) * o(attn(q(norm(x)), k(mem), v(mem)))`, optionally followed by a gated MLP.

    A GradientCheckpointingLayer, so activation checkpointing covers it as it covers transformers' own layers.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        mlp_intermediate_size: int | None = None,
        hidden_act: str = "silu",
        router: bool = False,
        lexical_gate: bool = False,
        lexical_tokens: bool = False,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.input_norm = modeling_qwen3.Qwen3RMSNorm(hidden_size, eps=rms_norm_eps)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=attention_bias)
        self.q_norm = modeling_qwen3.Qwen3RMSNorm(head_dim, eps=rms_norm_eps)
        self.k_norm = modeling_qwen3.Qwen3RMSNorm(head_dim, eps=rms_norm_eps)
        self.gate = nn.Parameter(torch.zeros(1))
        # chunk routing's summary keys (top_k > 0): the module docstring says why a projection of its own
        self.router = ChunkRouter(hidden_size, num_kv_heads, head_dim, rms_norm_eps) if router else None
        # memory_lexical_gate: each query token's share of the lexical prior (the module docstring says why)
        # and with the token prior a second output, its share of that
        self.lexical_gate = nn.Linear(hidden_size, 2 if lexical_tokens else 1) if lexical_gate else None
        self.mlp = None
        if mlp_intermediate_size:
            mlp_config = _MLPConfig(hidden_size, mlp_intermediate_size, hidden_act)
            self.mlp_norm = modeling_qwen3.Qwen3RMSNorm(hidden_size, eps=rms_norm_eps)
            self.mlp = modeling_qwen3.Qwen3MLP(mlp_config)
            self.mlp_gate = nn.Parameter(torch.zeros(1))

    def project_memory(self, memory_states: torch.Tensor, padding: "MemoryPadding | torch.Tensor") -> MemoryKV:
        """memory_states (B, M, hidden) in the decoder's width -> this layer's keys and values.
        `padding` is a MemoryPadding, or the (B, M) bool mask to derive it from."""
        if isinstance(padding, torch.Tensor):
            padding = MemoryPadding.from_mask(padding.bool())
        b, m, _ = memory_states.shape
        kv_shape = (b, m, self.num_kv_heads, self.head_dim)
        key = self.k_norm(self.k_proj(memory_states).view(kv_shape)).transpose(1, 2)  # (B, n_kv, M, hd)
        value = self.v_proj(memory_states).view(kv_shape).transpose(1, 2)  # (B, n_kv, M, hd)
        return MemoryKV(key=key, value=value, padding=padding)

    def forward(self, hidden_states: torch.Tensor, memory: MemoryKV) -> torch.Tensor:
        """hidden_states (B, T, hidden); B may be r * B_mem (beams, several questions per memory): row i reads
        memory i // r, by folding the r rows into the query length instead of copying the memory r times."""
        attended = self._attend(self.input_norm(hidden_states), memory)
        hidden_states = hidden_states + self.gate.tanh() * attended
        if self.mlp is not None:
            hidden_states = hidden_states + self.mlp_gate.tanh() * self.mlp(self.mlp_norm(hidden_states))
        return hidden_states

    def memory_attention(self, hidden_states: torch.Tensor, memory: MemoryKV) -> torch.Tensor:
        """The attention over memory tokens (B_mem, H, r*T, M), float32, that forward gives `hidden_states` (B, T,
        hidden): SDPA computes it without keeping it, so it is computed again here, for probes (where a block reads,
        its entropy), e.g. from a forward pre-hook."""
        with torch.no_grad():
            x = self.input_norm(hidden_states)
            return memory_probabilities(fold_queries(self._queries(x), memory), memory, scale=self.head_dim**-0.5,
                                        prior_scale=self._prior_scale(x, memory))

    def chunk_reading(self, hidden_states: torch.Tensor, memory: MemoryKV) -> tuple[torch.Tensor, torch.Tensor]:
        """Where routing sends each query of `hidden_states` (B, T, hidden) and where full attention would: the chunk
        scores the read selects its top-k by (the router's plus the lexical priors, as gated) and full attention's
        mass per chunk (full_attention_chunk_mass, the routing loss's teacher), each (B_mem, H_kv, r*T, C) float32,
        folded as forward folds the queries. For probes: when a question fails, did routing miss the evidence, or
        would full attention have missed it too?"""
        if memory.routing is None:
            raise ValueError("chunk_reading reads a routed memory: build the model with memory_top_k > 0")
        with torch.no_grad():
            x = self.input_norm(hidden_states)
            query, scale = fold_queries(self._queries(x), memory), self.head_dim**-0.5
            return (chunk_scores(query, memory.routing, scale, prior_scale=self._prior_scale(x, memory)),
                    full_attention_chunk_mass(query, memory, scale))

    def _attend(self, x: torch.Tensor, memory: MemoryKV) -> torch.Tensor:
        out, _ = attend_memory(self._queries(x), memory, prior_scale=self._prior_scale(x, memory))  # (B, T, H*hd)
        return self.o_proj(out)

    def _prior_scale(self, x: torch.Tensor, memory: MemoryKV) -> torch.Tensor | None:
        """Each query token's share of the lexical priors, folded as its queries are, (B_mem, 1, r*T, G) float32 (G:
        the question's, then the token prior's when gated apart); None without a gate or a prior."""
        routing = memory.routing
        if self.lexical_gate is None or routing is None or (routing.prior is None and routing.token_prior is None):
            return None
        gate = 2 * torch.sigmoid(self.lexical_gate(x).float())  # (B, T, G)
        return fold_queries(gate[..., None, :], memory)  # (B_mem, 1, r*T, G)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))  # (B, T, H, hd)


def attend_memory(query: torch.Tensor, memory: MemoryKV, *, scale: float | None = None, dropout_p: float = 0.0,
                  prior_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (B, T, H, hd), QK-normed, over one memory-reading layer's keys/values -> (B, T, H*hd), and the queries
    as attended, (B_mem, H, r*T, hd). B may be r * B_mem (beams, several questions per memory): row i reads memory
    i // r, by folding the r rows into the query length instead of copying the memory r times. A row whose memory is
    all padding reads nothing (zeros, not NaN). Shared by GCA blocks and the cross-attention layers. With
    `memory.routing` each query reads only its top-k chunks (and in training the routing loss is left in
    `memory.routing.loss`); with `memory.logn_base` queries are scaled by max(1, log n / log n_train). `prior_scale`
    (B_mem, 1, r*T, G): how much of the lexical priors each folded query takes (the block's lexical gate)."""
    b, t, h, hd = query.shape
    padding = memory.padding
    folded = fold_queries(query, memory)  # (B_mem, H, r*T, hd)
    routing = memory.routing
    if routing is None or not routing.selects:
        if routing is not None and routing.train:
            routing.loss = _routing_loss(folded, memory, scale or hd**-0.5)
        attended = folded
        if memory.logn_base:
            attended = folded * _logn_factor(_real_tokens(padding.attn_mask, memory.key.shape[2]), memory.logn_base,
                                             folded.dtype)
        out = grouped_sdpa(attended, memory.key, memory.value, padding.attn_mask, dropout_p=dropout_p,
                           scale=scale)  # (B_mem, H, r*T, hd)
    else:
        out = _attend_routed(folded, memory, scale or hd**-0.5, dropout_p, prior_scale)  # (B_mem, H, r*T, hd)
    if padding.has_memory is not None:
        out = out * padding.has_memory.to(out.dtype)
    return out.transpose(1, 2).reshape(b, t, h * hd), folded  # (B, T, H*hd)


def fold_queries(query: torch.Tensor, memory: MemoryKV) -> torch.Tensor:
    """Queries (B, T, H, hd), B = r * B_mem -> (B_mem, H, r*T, hd): row i's queries join memory i // r's."""
    b, t, h, hd = query.shape
    b_mem = memory.key.shape[0]
    if b % b_mem:
        raise ValueError(f"decoder batch {b} is not a multiple of the memory batch {b_mem}")
    r = b // b_mem
    if r != 1 and memory.padding.attn_mask is not None and memory.padding.attn_mask.shape[2] != 1:
        raise ValueError("packed memory masks are per query token: pass one memory row per decoder row")
    return query.reshape(b_mem, r * t, h, hd).transpose(1, 2)


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                 **kwargs) -> torch.Tensor:
    """SDPA of (B, H, Q, hd) queries over (B, H_kv, M, hd) keys/values, H a multiple of H_kv. CUDA's fused kernels
    take `enable_gqa` only without a mask (they require query, key and value to have the same num_heads), so a masked
    read there gets its kv heads repeated, as transformers' sdpa_attention does: the memory-efficient kernel instead
    of the math one, which materialises (B, H, Q, M) scores. Elsewhere `enable_gqa` reads the kv heads in place."""
    key, value, enable_gqa = kernel_heads(query, key, value, attn_mask)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)


def kernel_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The keys, values and `enable_gqa` that `grouped_sdpa` hands SDPA (tests/gpu checks a fused kernel takes them)."""
    group = query.shape[1] // key.shape[1]
    if group > 1 and attn_mask is not None and query.device.type == "cuda":
        return key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1), False
    return key, value, group > 1


def memory_probabilities(query: torch.Tensor, memory: MemoryKV, *, scale: float,
                         prior_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The attention (B_mem, H, Q, M) that `attend_memory` gives the folded queries (B_mem, H, Q, hd) over every
    memory token, in float32 (probes: entropy, evidence mass, top chunk). Routed, the unselected chunks' tokens are
    at 0 and the selected ones' sum to 1, as the routed softmax reads them."""
    query, key = query.detach(), memory.key.detach()
    b_mem, h, q, hd = query.shape
    n_kv, m = key.shape[1], key.shape[2]
    routing = memory.routing
    if routing is not None and routing.selects:
        chosen = _select(query, routing, scale, prior_scale)  # (B_mem, H_kv, Q, k)
        mask = _selected_tokens(chosen, routing, memory.padding.attn_mask)  # (B_mem, H_kv, Q, M)
        if memory.logn_base:
            query = query * _per_query_head(_logn_factor(mask.sum(-1, keepdim=True), memory.logn_base, query.dtype), h)
    else:
        mask = memory.padding.attn_mask  # (B_mem, 1, 1 or Q, M) or None
        if mask is not None:
            mask = mask.expand(b_mem, n_kv, q, m)
        if memory.logn_base:
            query = query * _logn_factor(_real_tokens(memory.padding.attn_mask, m), memory.logn_base, query.dtype)
    grouped = query.view(b_mem, n_kv, h // n_kv, q, hd)  # (B_mem, H_kv, G, Q, hd)
    scores = (grouped @ key[:, :, None].transpose(-1, -2)).float() * scale  # (B_mem, H_kv, G, Q, M)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if routing is not None and routing.selects and routing.weights == "router":  # each chunk's softmax, mixed
        c = routing.num_chunks
        within = scores.view(b_mem, n_kv, h // n_kv, q, c, m // c).softmax(-1).nan_to_num(0.0)
        weights = torch.zeros(b_mem, n_kv, q, c, device=query.device)
        weights.scatter_(-1, chosen, chunk_weights(chunk_scores(query, routing, scale, prior_scale=prior_scale),
                                                    chosen))
        return (within * weights[:, :, None, :, :, None]).reshape(b_mem, h, q, m)
    return scores.softmax(-1).reshape(b_mem, h, q, m)


class ChunkRouter(nn.Module):
    """One summary key per chunk and kv head: RMSNorm(W x) per head, x the projected memory state of the chunk's
    last real token (models/gca.py's docstring says why). Added to a memory-reading layer when `memory_top_k` > 0;
    trained by the routing loss alone."""

    def __init__(self, hidden_size: int, num_kv_heads: int, head_dim: int, rms_norm_eps: float = 1e-6):
        super().__init__()
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.norm = modeling_qwen3.Qwen3RMSNorm(head_dim, eps=rms_norm_eps)

    def forward(self, chunk_states: torch.Tensor) -> torch.Tensor:
        """chunk_states (B, C, hidden) -> summary keys (B, n_kv_heads, C, head_dim)."""
        b, c, _ = chunk_states.shape
        return self.norm(self.proj(chunk_states).view(b, c, self.num_kv_heads, self.head_dim)).transpose(1, 2)


def chunk_summary_states(states: torch.Tensor, mask: torch.Tensor, chunk_len: int) -> torch.Tensor:
    """The memory (B, C*L, hidden) and its mask (B, C*L) -> each chunk's last real token's state (B, C, hidden)
    (position 0's, zeroed, for an all-padding chunk: it is never selected)."""
    b, m, d = states.shape
    if m % chunk_len:
        raise ValueError(f"a memory of {m} positions is not made of chunks of {chunk_len}")
    c = m // chunk_len
    positions = torch.arange(chunk_len, device=mask.device)
    last = torch.where(mask.view(b, c, chunk_len), positions, -1).amax(-1).clamp_min(0)  # (B, C)
    return states.view(b, c, chunk_len, d).gather(2, last[:, :, None, None].expand(b, c, 1, d)).squeeze(2)


def chunk_mask(padding: MemoryPadding, chunk_len: int) -> torch.Tensor | None:
    """Which chunks each query may read, (B_mem, 1, 1 or T, C), from the memory's padding; None: all of them."""
    if padding.attn_mask is None:
        return None
    b, _, rows, m = padding.attn_mask.shape
    return padding.attn_mask.view(b, 1, rows, m // chunk_len, chunk_len).any(-1)


def chunk_scores(query: torch.Tensor, routing: ChunkRouting, scale: float, *, train_queries: bool = False,
                 with_prior: bool = True, prior_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Folded queries (B_mem, H, Q, hd) -> chunk scores (B_mem, H_kv, Q, C) in float32, -inf where the query may
    not read the chunk; with S summaries a chunk, the best of its blocks' scores, plus the question's lexical prior
    when there is one (not `with_prior`: the routing loss, which trains the router's own scores). The queries are
    detached unless `train_queries` (the router-weighted read): the routing loss trains the summary keys only.
    `prior_scale` (B_mem, 1, Q, G): each query's share of the question's prior and (last column) of the token prior
    (the lexical gate); None: all of both."""
    b_mem, h, q, hd = query.shape
    n_kv = routing.summary.shape[1]
    grouped = (query if train_queries else query.detach()).view(b_mem, n_kv, h // n_kv, q, hd).mean(2)
    scores = (grouped @ routing.summary.transpose(-1, -2)).float() * scale  # (B_mem, H_kv, Q, C * S)
    if routing.summaries > 1:  # a chunk's score is its best readable block's
        if routing.summary_mask is not None:
            scores = scores.masked_fill(~routing.summary_mask, float("-inf"))
        scores = scores.view(b_mem, n_kv, q, routing.num_chunks, routing.summaries).amax(-1)  # (B_mem, H_kv, Q, C)
    if with_prior and routing.prior is not None:
        prior = _per_query(routing.prior, q)
        scores = scores + (prior if prior_scale is None else prior * prior_scale[..., :1])
    if with_prior and routing.token_prior is not None:
        if routing.token_prior.shape[1] != q:
            raise ValueError(f"a token prior for {routing.token_prior.shape[1]} queries does not fit {q}: hold the "
                             f"tokens of the rows being read (GCAMemory.hold_tokens; AwarenessModel does)")
        tokens = routing.token_prior[:, None]  # (B_mem, 1, Q, C)
        scores = scores + (tokens if prior_scale is None else tokens * prior_scale[..., -1:])
    if routing.chunk_mask is not None:
        scores = scores.masked_fill(~routing.chunk_mask, float("-inf"))
    return scores


def _per_query(prior: torch.Tensor, q: int) -> torch.Tensor:
    """A prior per decoder row (B_mem, R, C) -> per folded query (B_mem, 1, Q, C): row i's T = Q / R queries share
    row i's prior (R = 1: every query of the memory, e.g. a prompt's beams)."""
    rows = prior.shape[1]
    if q % rows:
        raise ValueError(f"a lexical prior for {rows} rows does not fold onto {q} queries: compute it for the rows "
                         f"being decoded (AwarenessModel.forward and generate do)")
    return prior.repeat_interleave(q // rows, dim=1)[:, None] if rows > 1 else prior[:, None]


def _select(query: torch.Tensor, routing: ChunkRouting, scale: float,
            prior_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The top-k chunks of each query and kv head, (B_mem, H_kv, Q, k) indices. A query with fewer readable chunks
    than k also gets unreadable ones, whose tokens its padding mask then hides."""
    with torch.no_grad():
        return chunk_scores(query, routing, scale, prior_scale=prior_scale).topk(routing.top_k, dim=-1).indices


def _selected_tokens(chosen: torch.Tensor, routing: ChunkRouting, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """Chunk indices (B_mem, H_kv, Q, k) -> the memory tokens each query reads, (B_mem, H_kv, Q, M) bool."""
    selected = torch.zeros(*chosen.shape[:-1], routing.num_chunks, dtype=torch.bool, device=chosen.device)
    tokens = selected.scatter_(-1, chosen, True).repeat_interleave(routing.chunk_len, dim=-1)  # (B_mem, H_kv, Q, M)
    return tokens if attn_mask is None else tokens & attn_mask


def _attend_routed(query: torch.Tensor, memory: MemoryKV, scale: float, dropout_p: float,
                   prior_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Folded queries (B_mem, H, Q, hd) over the tokens of their top-k chunks -> (B_mem, H, Q, hd)."""
    routing = memory.routing
    b_mem, h, q, hd = query.shape
    n_kv, group, k, length = memory.key.shape[1], h // memory.key.shape[1], routing.top_k, routing.chunk_len
    if routing.train:
        routing.loss = _routing_loss(query, memory, scale)
    if routing.weights == "router":  # the scores, with gradients, both choose the chunks and mix them
        scores = chunk_scores(query, routing, scale, train_queries=True, prior_scale=prior_scale)  # (B_mem,H_kv,Q,C)
        chosen = scores.detach().topk(k, dim=-1).indices
        weights = chunk_weights(scores, chosen)
        if _reads_gathered(routing, q, query.device):
            return _attend_router_weighted(query, memory, chosen, weights, scale, dropout_p)
        return _attend_every_chunk(query, memory, torch.zeros_like(scores, dtype=weights.dtype).scatter(
            -1, chosen, weights), scale, dropout_p)
    chosen = _select(query, routing, scale, prior_scale)  # (B_mem, H_kv, Q, k)
    gathered = _reads_gathered(routing, q, query.device)
    if not gathered:  # the whole memory, the unselected chunks masked: O(Q * M), for long query blocks
        mask = _selected_tokens(chosen, routing, memory.padding.attn_mask)  # (B_mem, H_kv, Q, M)
        if memory.logn_base:
            query = query * _per_query_head(_logn_factor(mask.sum(-1, keepdim=True), memory.logn_base, query.dtype), h)
        mask = mask.repeat_interleave(group, dim=1) if group > 1 else mask  # (B_mem, H, Q, M)
        return grouped_sdpa(query, memory.key, memory.value, mask, dropout_p=dropout_p, scale=scale)
    # each query's k chunks gathered: O(Q * k * L), what a decoding step pays whatever the memory's length
    key, value, mask = _gather_chunks(memory, chosen)
    key, value = (x.reshape(b_mem, n_kv, q, k * length, hd) for x in (key, value))
    mask = None if mask is None else mask.reshape(b_mem, n_kv, q, 1, k * length)
    grouped = query.view(b_mem, n_kv, group, q, hd).transpose(2, 3)  # (B_mem, H_kv, Q, G, hd)
    if memory.logn_base:
        read = mask.sum(-1, keepdim=True) if mask is not None else torch.tensor(float(k * length))
        grouped = grouped * _logn_factor(read, memory.logn_base, grouped.dtype)
    # one (query, kv head) per batch row: 4-D, so SDPA takes its fused kernels (5-D falls back to the math path)
    rows = b_mem * n_kv * q
    out = F.scaled_dot_product_attention(grouped.reshape(rows, 1, group, hd), key.view(rows, 1, k * length, hd),
                                         value.view(rows, 1, k * length, hd), dropout_p=dropout_p, scale=scale,
                                         attn_mask=None if mask is None else mask.view(rows, 1, 1, k * length))
    return out.view(b_mem, n_kv, q, group, hd).transpose(2, 3).reshape(b_mem, h, q, hd)


# On CPU the router-weighted read of a long query block costs more attending every chunk than copying each query's
# k chunks out once the memory holds about 10 x k chunks (benchmarks/routed_training.py measures it). On an
# accelerator every chunk stays: one fused kernel, where gathering copies Q x k x L keys and values per kv head.
ROUTER_GATHERS_FROM_CHUNKS_PER_K = 10


def _reads_gathered(routing: ChunkRouting, queries: int, device: torch.device) -> bool:
    """The gathered path (each query's k chunks copied out) for few queries, as a decoding step has; the whole memory
    once (masked, or every chunk attended) when queries x k exceed the chunks: the cheaper form for long blocks,
    except the router-weighted read on CPU over a memory of 10 x k chunks or more."""
    if routing.path != "auto":
        return routing.path == "gathered"
    if queries * routing.top_k <= routing.num_chunks:
        return True
    return (routing.weights == "router" and device.type == "cpu"
            and routing.num_chunks >= ROUTER_GATHERS_FROM_CHUNKS_PER_K * routing.top_k)


def _gather_chunks(memory: MemoryKV, chosen: torch.Tensor):
    """The k chosen chunks' keys and values, (B_mem, H_kv, Q, k, L, hd) each, and their padding (B_mem, H_kv, Q, k, L)
    bool or None."""
    routing = memory.routing
    b_mem, n_kv, q, k = chosen.shape
    c, length, hd = routing.num_chunks, routing.chunk_len, memory.key.shape[-1]
    # whole chunks, from the memory itself: gathering from a view expanded over the queries would make the backward
    # fill and scatter into a (Q, C, L, hd) gradient, the whole memory once per query. A view, never a reshape: the
    # keys are a transposed (B, M, H_kv, hd) projection, and merging L with hd would copy the memory every step.
    index = chosen.reshape(b_mem, n_kv, q * k, 1, 1).expand(b_mem, n_kv, q * k, length, hd)

    def gather(x: torch.Tensor) -> torch.Tensor:
        return x.view(b_mem, n_kv, c, length, hd).gather(2, index).view(b_mem, n_kv, q, k, length, hd)

    mask = None
    if memory.padding.attn_mask is not None:
        tokens = memory.padding.attn_mask.view(b_mem, 1, -1, c, length).expand(b_mem, n_kv, q, c, length)
        mask = tokens.gather(3, chosen[..., None].expand(b_mem, n_kv, q, k, length))
    return gather(memory.key), gather(memory.value), mask


def chunk_weights(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The router-weighted read's mix of a query's k chosen chunks from the chunk scores (B_mem, H_kv, Q, C):
    softmax over the chosen ones', (B_mem, H_kv, Q, k) float32, with the scores' gradients. An unreadable chunk
    (chosen only because fewer than k are readable) weighs 0; a query with no readable chunk gets uniform weights
    over outputs its row then drops."""
    scores = scores.gather(-1, chosen)
    scores = scores.masked_fill(~scores.isfinite().any(-1, keepdim=True), 0.0)
    return scores.softmax(-1)


def _attend_router_weighted(query: torch.Tensor, memory: MemoryKV, chosen: torch.Tensor, weights: torch.Tensor,
                            scale: float, dropout_p: float) -> torch.Tensor:
    """Folded queries (B_mem, H, Q, hd): attention inside each of the k chosen chunks, the outputs mixed by
    `weights` (chunk_weights, (B_mem, H_kv, Q, k)) -> (B_mem, H, Q, hd)."""
    if memory.logn_base:
        raise ValueError("memory_logn_scale scales one softmax over the memory; the router-weighted read has one per "
                         "chunk: set memory_logn_scale 0 or memory_chunk_weights 'attention'")
    b_mem, h, q, hd = query.shape
    n_kv, k, length = memory.key.shape[1], chosen.shape[-1], memory.routing.chunk_len
    group = h // n_kv
    key, value, mask = _gather_chunks(memory, chosen)  # (B_mem, H_kv, Q, k, L, hd), (B_mem, H_kv, Q, k, L)
    if mask is not None:  # an unreadable chosen chunk attends its padding instead of an empty softmax; it weighs 0
        mask = mask | ~mask.any(-1, keepdim=True)
    grouped = query.view(b_mem, n_kv, group, q, hd).transpose(2, 3)  # (B_mem, H_kv, Q, G, hd)
    rows = b_mem * n_kv * q * k  # one (query, kv head, chunk) per batch row, 4-D for the fused kernels
    per_chunk = F.scaled_dot_product_attention(
        grouped[:, :, :, None].expand(b_mem, n_kv, q, k, group, hd).reshape(rows, 1, group, hd),
        key.reshape(rows, 1, length, hd), value.reshape(rows, 1, length, hd), dropout_p=dropout_p, scale=scale,
        attn_mask=None if mask is None else mask.reshape(rows, 1, 1, length))
    weights = weights.to(per_chunk.dtype)
    out = (per_chunk.view(b_mem, n_kv, q, k, group, hd) * weights[..., None, None]).sum(3)  # (B_mem, H_kv, Q, G, hd)
    return out.transpose(2, 3).reshape(b_mem, h, q, hd)


def _attend_every_chunk(query: torch.Tensor, memory: MemoryKV, weights: torch.Tensor, scale: float,
                        dropout_p: float) -> torch.Tensor:
    """The router-weighted read for long query blocks (training): folded queries (B_mem, H, Q, hd) attend inside
    every chunk, one chunk a head of one SDPA call, and the outputs are mixed by `weights` (B_mem, H_kv, Q, C), 0 on
    the chunks not chosen. The same result as `_attend_router_weighted`, at Q x C x L instead of Q x k x L scores,
    without copying each query's chunks out (whose backward scatters into the memory once per query)."""
    b_mem, h, q, hd = query.shape
    n_kv, c, length = memory.key.shape[1], memory.routing.num_chunks, memory.routing.chunk_len
    group = h // n_kv
    rows = b_mem * n_kv
    grouped = query.view(b_mem, n_kv, group, q, hd).transpose(2, 3).reshape(rows, 1, q * group, hd)  # (.., Q*G, hd)
    mask = None
    if memory.padding.attn_mask is not None:  # (B_mem, 1, 1 or Q, M) -> per chunk, (rows, C, Q*G or 1, L)
        tokens = memory.padding.attn_mask.view(b_mem, 1, -1, c, length).transpose(2, 3)  # (B_mem, 1, C, 1|Q, L)
        tokens = tokens | ~tokens.any(-1, keepdim=True)  # a chunk with nothing readable attends its padding; weighs 0
        if tokens.shape[3] > 1:
            tokens = tokens[:, :, :, :, None].expand(b_mem, 1, c, q, group, length).reshape(b_mem, 1, c, q * group,
                                                                                             length)
        mask = tokens.expand(b_mem, n_kv, *tokens.shape[2:]).reshape(rows, c, tokens.shape[3], length)
    per_chunk = F.scaled_dot_product_attention(
        grouped.expand(rows, c, q * group, hd), memory.key.reshape(rows, c, length, hd),
        memory.value.reshape(rows, c, length, hd), attn_mask=mask, dropout_p=dropout_p, scale=scale)  # (rows,C,Q*G,hd)
    per_chunk = per_chunk.view(b_mem, n_kv, c, q, group, hd)
    out = torch.einsum("bncqgd,bnqc->bnqgd", per_chunk, weights.to(per_chunk.dtype))  # (B_mem, H_kv, Q, G, hd)
    return out.transpose(2, 3).reshape(b_mem, h, q, hd)


def _routing_loss(query: torch.Tensor, memory: MemoryKV, scale: float) -> torch.Tensor:
    """KL(full attention's chunk mass || the router's chunk distribution), per query and kv head, averaged over the
    queries that read a memory. The teacher is computed without gradient from full attention's logits (as unrouted
    attention would scale them); only the summary keys get gradients."""
    routing, padding = memory.routing, memory.padding
    b_mem, _, q, _ = query.shape
    n_kv = memory.key.shape[1]
    teacher = full_attention_chunk_mass(query, memory, scale)  # (B_mem, H_kv, Q, C)
    with torch.no_grad():
        weight = torch.ones(b_mem, 1, q, device=query.device)
        if padding.has_memory is not None:
            weight = weight * padding.has_memory[:, :, :, 0].float().expand(b_mem, 1, q)
    log_router = chunk_scores(query, routing, scale, with_prior=False).log_softmax(-1).masked_fill(teacher == 0, 0.0)
    kl = (teacher * (teacher.clamp_min(1e-30).log() - log_router)).sum(-1)  # (B_mem, H_kv, Q)
    return (kl * weight).sum() / (weight.sum() * n_kv).clamp_min(1.0)


@torch.no_grad()
def full_attention_chunk_mass(query: torch.Tensor, memory: MemoryKV, scale: float) -> torch.Tensor:
    """Folded queries (B_mem, H, Q, hd) -> the mass full attention (unrouted, as the block would read without
    routing) puts on each chunk, a kv head's query heads averaged: (B_mem, H_kv, Q, C) float32, no gradient. The
    routing loss's teacher, and the probes' reference for where the router should send a query."""
    routing, padding = memory.routing, memory.padding
    b_mem, h, q, hd = query.shape
    n_kv, m, c = memory.key.shape[1], memory.key.shape[2], routing.num_chunks
    full = query.detach()
    if memory.logn_base:
        full = full * _logn_factor(_real_tokens(padding.attn_mask, m), memory.logn_base, full.dtype)
    grouped = full.view(b_mem, n_kv, h // n_kv, q, hd)  # (B_mem, H_kv, G, Q, hd)
    logits = (grouped * scale @ memory.key.detach()[:, :, None].transpose(-1, -2)).float()  # (B_mem, H_kv, G, Q, M)
    if padding.attn_mask is not None:
        logits = logits.masked_fill_(~padding.attn_mask[:, :, None], float("-inf"))
    # a chunk's mass is the sum of its tokens' full-attention probabilities (= the softmax over chunks of their
    # logsumexps): one fused softmax over the memory, about half the passes of a per-chunk logsumexp
    mass = logits.softmax(-1).view(*logits.shape[:-1], c, routing.chunk_len).sum(-1)  # (B_mem, H_kv, G, Q, C)
    return mass.mean(2)


def _real_tokens(attn_mask: torch.Tensor | None, m: int) -> torch.Tensor:
    """Real memory tokens each query reads without routing: (B_mem, 1, 1 or T, 1), or M when nothing is padded."""
    return torch.tensor(float(m)) if attn_mask is None else attn_mask.sum(-1, keepdim=True)


def _logn_factor(tokens: torch.Tensor, base: int, dtype: torch.dtype) -> torch.Tensor:
    """max(1, log n / log n_train): exactly 1 up to the trained length (n <= n_train), whatever the rounding."""
    tokens = tokens.float()
    return torch.where(tokens > base, tokens.clamp_min(1.0).log() / math.log(base), 1.0).to(dtype)


def _per_query_head(factor: torch.Tensor, heads: int) -> torch.Tensor:
    """A per-kv-head factor (B_mem, H_kv, Q, 1) -> per query head (B_mem, H, Q, 1)."""
    return factor.repeat_interleave(heads // factor.shape[1], dim=1)


@dataclass
class _MLPConfig:
    """The three fields transformers' Qwen3MLP reads from a config."""

    hidden_size: int
    intermediate_size: int
    hidden_act: str


class MemoryReadingLayer(nn.Module):
    """A transformers decoder layer with a GCA block in front of it.

    The memory arrives as the `gca_memory` keyword that `Qwen3ForCausalLM.forward` threads through its `**kwargs`
    down to every layer; layers without a block ignore it.
    """

    def __init__(self, decoder_layer: nn.Module, cross_attention: GatedCrossAttention, layer_idx: int):
        super().__init__()
        self.cross_attention = cross_attention
        self.decoder_layer = decoder_layer
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args, gca_memory: "GCAMemory | None" = None, **kwargs):
        if gca_memory is not None:
            kv = gca_memory.layers[self.layer_idx]
            hidden_states = self.cross_attention(hidden_states, kv)
        return self.decoder_layer(hidden_states, *args, **kwargs)


@dataclass
class AnswerSoFar:
    """Where a forward's tokens stand in their rows' answers, for the token prior's window (memory_lexical_window):
    which of them are answer tokens, and each row's answer tokens before them."""

    fed: torch.Tensor  # (B, T) bool: this forward's answer tokens (a question's are False)
    before: torch.Tensor | None = None  # (B, A) long: the rows' earlier answer tokens, NO_TOKEN where shorter

    @classmethod
    def continuing(cls, answers: list[list[int]], fed: int, device: torch.device | str = "cpu") -> "AnswerSoFar":
        """`fed` tokens a row, each continuing its row's answer `answers[i]` (the tokens before them)."""
        width = max((len(a) for a in answers), default=0)
        before = torch.tensor([[NO_TOKEN] * (width - len(a)) + list(a) for a in answers], dtype=torch.long,
                              device=device).view(len(answers), width)
        return cls(fed=torch.ones(len(answers), fed, dtype=torch.bool, device=device), before=before)


@dataclass
class GCAMemory:
    """Everything the GCA layers read: keys/values per layer, computed once and reused at every decoding step."""

    layers: dict[int, MemoryKV]
    states: torch.Tensor  # (B_mem, M, decoder hidden): the projected memory, kept for inspection and logging
    mask: torch.Tensor  # (B_mem, M) bool
    chunk_len: int | None = None  # L when the memory is C chunks of L positions (routing needs it); None: unknown
    chunk_ids: tuple[torch.Tensor, torch.Tensor] | None = None  # the chunks' token ids and mask (B_mem, C, L) each
    token_index: TokenIndex | None = None  # the chunks' tokens indexed for the token prior, built at its first use
    # the next forward's place in its rows' answers (the token prior's window); None: its tokens are the question's
    answer: AnswerSoFar | None = None
    answer_tail: torch.Tensor | None = None  # (B, < W) the last answer tokens fed (AwarenessModel.forward keeps it)
    answer_start: int | None = None  # generate: the prompt's length; its decoding steps feed the answer from there

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def hold_tokens(self, input_ids: torch.Tensor | None, weight: float, window: int = 1,
                    carry: float = 1.0) -> None:
        """Sets each routing layer's token prior for this forward's rows (B, T), B = r * B_mem, times `weight`
        (memory_lexical_tokens); `input_ids` None clears it. In place: generate hands the same memory to every
        decoding step, and each step's prior is its own token's. A memory read in full (no routing) takes none.
        `window` W > 1 (memory_lexical_window): an answer token takes the largest prior of its answer's last W tokens
        (models/lexical.py), where `self.answer` says which tokens answer; without it every token is the question's.
        `carry` (memory_lexical_window_carry): the earlier tokens' priors count at that fraction."""
        routings = [kv.routing for kv in self.layers.values() if kv.routing is not None]
        prior = None
        if input_ids is not None and routings:
            if self.chunk_ids is None:
                raise ValueError("memory_lexical_tokens compares each token with the memory's, and this memory came "
                                 "without them: pass memory_input_ids (B, C, L), or chunked memory_states with "
                                 "memory_chunk_ids (MemoryStore.token_ids)")
            if self.token_index is None:
                self.token_index = TokenIndex.of(*self.chunk_ids)
            if input_ids.shape[0] % self.batch_size:
                raise ValueError(f"decoder batch {input_ids.shape[0]} is not a multiple of the memory batch "
                                 f"{self.batch_size}")
            prior = weight * self._token_prior(input_ids, window, carry)  # (B_mem, r*T, C)
        for routing in routings:
            routing.token_prior = prior

    def follow_generation(self, input_ids: torch.Tensor, fed: int) -> None:
        """generate (`answer_start` set): the rows so far (B, T), prompt and answer, of which the next forward feeds
        the last `fed`: sets `answer` from them. Read from the rows each step, so beam search's reordering holds."""
        start = input_ids.shape[1] - fed
        positions = torch.arange(start, input_ids.shape[1], device=input_ids.device)
        self.answer = AnswerSoFar(fed=(positions >= self.answer_start).expand(input_ids.shape[0], fed),
                                  before=input_ids[:, self.answer_start:start] if start > self.answer_start else None)

    def _token_prior(self, input_ids: torch.Tensor, window: int, carry: float = 1.0) -> torch.Tensor:
        """(B, T) ids -> (B_mem, r*T, C): each token's prior, or with a window and an answer the largest over it, the
        earlier tokens' times `carry`."""
        if window == 1 or self.answer is None:
            return self.token_index.prior(input_ids.reshape(self.batch_size, -1))
        if self.answer.fed.shape != input_ids.shape:
            raise ValueError(f"the answer's place {tuple(self.answer.fed.shape)} does not fit this forward's tokens "
                             f"{tuple(input_ids.shape)}: set GCAMemory.answer for the rows being read")
        windows = answer_windows(input_ids, self.answer.fed, window, self.answer.before)  # (B, T, W)
        prior = None
        for position in range(window):  # the largest over the window, one (B_mem, r*T, C) prior at a time
            one = self.token_index.prior(windows[..., position].reshape(self.batch_size, -1).contiguous())
            if position < window - 1 and carry != 1:  # an earlier token's (the last position is the token's own)
                one = carry * one
            prior = one if prior is None else torch.maximum(prior, one)
        return prior

    def question_rows(self, rows: torch.Tensor) -> "GCAMemory":
        """This memory with its routing priors (AwarenessModel.with_question: one per decoder row) kept for `rows`
        only, in that order: what a decoding batch keeps when some of its rows finish."""
        return self._with_priors(lambda prior: prior.index_select(1, rows.to(prior.device)))

    def joined(self, other: "GCAMemory") -> "GCAMemory":
        """This memory read by this one's decoder rows and then `other`'s (the same memory, other questions): the
        rows' routing priors concatenated, as a decoding batch admits new rows."""
        priors = {i: kv.routing.prior for i, kv in other.layers.items() if kv.routing is not None}
        return self._with_priors(lambda prior, i: torch.cat([prior, priors[i]], dim=1), by_layer=True)

    def _with_priors(self, change, by_layer: bool = False) -> "GCAMemory":
        layers = {i: kv if kv.routing is None or kv.routing.prior is None else
                  replace(kv, routing=replace(kv.routing, prior=change(kv.routing.prior, i) if by_layer
                                              else change(kv.routing.prior)))
                  for i, kv in self.layers.items()}
        return replace(self, layers=layers, answer=None, answer_tail=None)  # the answer's rows are the caller's to set


def gca_parameter_count(
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_gca_layers: int,
    encoder_hidden_size: int,
    attention_bias: bool = False,
    mlp_intermediate_size: int | None = None,
    router: bool = False,
    lexical_gate: bool = False,
    lexical_tokens: bool = False,
) -> int:
    """Closed form of the parameters AwarenessModel adds to the pair: GCA blocks (with chunk routers when `router`,
    memory_top_k > 0, and lexical gates when `lexical_gate`, two outputs each with `lexical_tokens`) plus the shared
    projection."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    attention = hidden_size + hidden_size * q + 2 * hidden_size * kv + q * hidden_size + 2 * head_dim + 1
    attention += hidden_size * kv + head_dim if router else 0
    attention += (hidden_size + 1) * (2 if lexical_tokens else 1) if lexical_gate else 0
    if attention_bias:
        attention += q + 2 * kv + hidden_size
    mlp = hidden_size + 3 * hidden_size * mlp_intermediate_size + 1 if mlp_intermediate_size else 0
    projection = encoder_hidden_size * hidden_size if encoder_hidden_size != hidden_size else 0
    return num_gca_layers * (attention + mlp) + projection
