"""FLOPs of one training step of an AwarenessModel, computed analytically from its configs (for MFU).

Conventions (checked against torch's FlopCounterMode in tests/models/test_flops.py):

* Matmul FLOPs only, 2 per multiply-add: every linear layer (base weights and LoRA adapters), the LM head (over the
  positions the loss reads: models/loss.py skips the rest), and
  attention's two products (scores Q·Kᵀ and the weighted sum P·V: 4 · q_len · kv_len · head_dim per head). Norms,
  activations, softmax, RoPE, the loss and the optimizer update are left out, as FlopCounterMode leaves them out.
* Causal attention ("model FLOPs actually required", what MFU reports): a causal self-attention over q tokens counts
  the q·(q+1)/2 query-key pairs the mask keeps, which is what a causal flash kernel computes. `causal="full"`
  counts all q² pairs instead, as dense SDPA (and FlopCounterMode, whatever the mask) does. Cross-attention over
  the memory and a bidirectional encoder count all pairs either way.
* Backward, from what actually requires grad (each group's mode read off requires_grad, the LoRA ranks off the
  injected PEFT layers: models.trainable's trainable_modes and LoraPlan.of): a matmul y = x·Wᵀ costs its
  forward once more for the input gradient when x requires grad (something trainable lies below it) and once
  more for the weight gradient when W trains. Frozen weights need no weight gradient, and
  everything below the lowest trainable weight needs no backward at all: a frozen encoder runs forward only, and
  with a frozen decoder only the layers from the first GCA block up run backward. Attention's backward costs one
  forward product per gradient product it needs (dV, dP, dQ, dK): twice its forward whenever Q, K and V all require
  grad, which holds in every layer but possibly the first (fused GPU kernels compute all four there too).
  With LoRA on every decoder layer and the GCA blocks and projection trained in full (the pipeline's
  configuration) a step is thus about forward + 1 × forward over the decoder and GCA (input gradients) plus the
  small weight gradients of LoRA and GCA, not the 3 × forward of full training.
* Gradient-checkpointing recomputation is not counted: it is work the hardware does (HFU), not work the model
  needs (MFU).
* `approx_6nt` is the common approximation 6·N·T, as if every weight trained and attention were free: N is each
  side's parameters except input embedding tables (the LM head counts once, tied or not; GCA blocks and the
  projection count with the decoder), T its tokens: 6·N_decoder·(decoder tokens) + 6·N_encoder·(memory tokens).

* Qwen3-MoE: the router over every token and each token through its top-k experts (the active parameters, what
  MoE MFU reports), as transformers' expert loop computes them.

Rows are assumed unpadded and unpacked (every position real, attention within a row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

import torch
from torch import nn
from torch.utils import flop_counter as _counter

from models.loss import IGNORE_INDEX, shift_labels
from models.trainable import EXPERTS, LoraPlan, trainable_modes

PARTS = ("encoder", "gca", "decoder", "lm_head")


@dataclass
class StepFlops:
    """Matmul FLOPs of one training step (forward + backward) by part: encoder, gca (blocks and memory projection),
    decoder (its layers, LoRA included), lm_head."""

    forward: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    backward: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    approx_6nt: float = 0.0

    @property
    def forward_total(self) -> float:
        return sum(self.forward.values())

    @property
    def backward_total(self) -> float:
        return sum(self.backward.values())

    @property
    def total(self) -> float:
        return self.forward_total + self.backward_total


class _Tally:
    def __init__(self, flops: StepFlops, full_causal: bool):
        self.flops, self.full_causal = flops, full_causal

    def matmul(self, part: str, tokens: int, d_in: int, d_out: int, x_grad: bool, w_grad: bool) -> bool:
        """y = x·Wᵀ over `tokens` rows; returns whether y requires grad."""
        f = 2.0 * tokens * d_in * d_out
        self.flops.forward[part] += f
        self.flops.backward[part] += f * (int(x_grad) + int(w_grad))
        return x_grad or w_grad

    def linear(self, part: str, tokens: int, d_in: int, d_out: int, x_grad: bool, trains: bool,
               lora_rank: int | None = None, lora_trains: bool = False) -> bool:
        """A base projection and, when one is injected, its LoRA adapter B(A(x))."""
        out = self.matmul(part, tokens, d_in, d_out, x_grad, trains)
        if lora_rank:
            a = self.matmul(part, tokens, d_in, lora_rank, x_grad, lora_trains)
            out = self.matmul(part, tokens, lora_rank, d_out, a, lora_trains) or out
        return out

    def attention(self, part: str, rows: int, heads: int, head_dim: int, q_len: int, kv_len: int, *, causal: bool,
                  grads: tuple[bool, bool, bool]) -> bool:
        """Scores S = Q·Kᵀ and output O = P·V; backward needs dV = Pᵀ·dO (V requires grad), dP = dO·Vᵀ (Q or K
        does), dQ = dS·K and dK = dSᵀ·Q, each product costing as much as one forward product. Returns whether O
        requires grad."""
        q, k, v = grads
        pairs = q_len * (q_len + 1) / 2 if causal and not self.full_causal else q_len * kv_len
        product = 2.0 * rows * heads * head_dim * pairs
        self.flops.forward[part] += 2 * product
        self.flops.backward[part] += product * (int(v) + int(q or k) + int(q) + int(k))
        return q or k or v


@dataclass
class _Group:
    """How one group of the model trains: its mode and the ranks of the LoRA adapters injected into it."""

    mode: str
    lora: dict[str, int]

    @property
    def base_trains(self) -> bool:
        return self.mode == "full"

    @property
    def lora_trains(self) -> bool:
        return self.mode == "lora"

    def linear(self, tally: _Tally, part: str, name: str, tokens: int, d_in: int, d_out: int, x_grad: bool) -> bool:
        return tally.linear(part, tokens, d_in, d_out, x_grad, self.base_trains, self.lora.get(name), self.lora_trains)


def training_flops(model: nn.Module, batch: Mapping[str, torch.Tensor],
                   causal: Literal["required", "full"] = "required") -> StepFlops:
    """FLOPs of forward + backward of `model(**batch, labels=...)`, from the configs and the batch's shapes.

    `batch` holds input_ids (B, T) and optionally memory_input_ids (B, C, L) (encoded in the step) or
    memory_states (B, M, H_enc) (from a store: no encoder); without a memory the GCA blocks do not run.
    See the module docstring for the conventions."""
    if causal not in ("required", "full"):
        raise ValueError(f"causal must be 'required' or 'full', got {causal!r}")
    dcfg = model.decoder.config
    if getattr(model, "fusion", "gca") != "gca":
        raise NotImplementedError(f"training_flops accounts GCA blocks only, not fusion={model.fusion!r}")
    flops = StepFlops()
    tally = _Tally(flops, full_causal=causal == "full")
    groups = _groups(model)
    rows, seq = batch["input_ids"].shape

    memory = None  # (memory rows, memory tokens per row, whether the projected memory requires grad)
    if batch.get("memory_input_ids") is not None:
        ids = batch["memory_input_ids"]
        ids = ids[:, None, :] if ids.dim() == 2 else ids
        mem_rows, chunks, chunk_len = ids.shape
        encoder = model.memory_encoder
        grad = _stack(tally, "encoder", encoder.encoder.config, groups["encoder"], rows=mem_rows * chunks,
                      seq=chunk_len, causal=encoder.attention == "causal", stream_grad=groups["encoder"].base_trains)
        memory = (mem_rows, chunks * chunk_len, grad or groups["encoder"].base_trains)  # final norm trains in full
    elif batch.get("memory_states") is not None:
        mem_rows, length, _ = batch["memory_states"].shape
        memory = (mem_rows, length, False)
    if memory is not None and isinstance(model.memory_projection, nn.Linear):
        projection = model.memory_projection
        grad = tally.matmul("gca", memory[0] * memory[1], projection.in_features, projection.out_features,
                            memory[2], groups["gca"].base_trains)
        memory = (memory[0], memory[1], grad)

    def gca_block(layer: int, stream_grad: bool) -> bool:
        if memory is None or layer not in model.gca_layers:
            return stream_grad
        return _gca_block(tally, model.gca_blocks()[layer], groups["gca"], rows, seq, memory, stream_grad)

    decoder = groups["decoder"]
    grad = _stack(tally, "decoder", dcfg, decoder, rows=rows, seq=seq, causal=True,
                  stream_grad=decoder.base_trains, before_layer=gca_block)
    tally.matmul("lm_head", _predicting_tokens(batch), dcfg.hidden_size, dcfg.vocab_size, grad or decoder.base_trains,
                 decoder.base_trains)
    flops.approx_6nt = _approx_6nt(model, rows * seq, memory[0] * memory[1] if memory is not None else 0,
                                   encoded=batch.get("memory_input_ids") is not None)
    return flops


def _predicting_tokens(batch: Mapping[str, torch.Tensor]) -> int:
    """Positions whose logits the loss needs (models/loss.py runs the LM head on those only): the labelled ones, or
    without labels every position but each row's last, which predicts nothing."""
    if batch.get("labels") is not None:
        return int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())
    rows, seq = batch["input_ids"].shape
    return rows * (seq - 1)


def _stack(tally: _Tally, part: str, cfg, group: _Group, *, rows: int, seq: int, causal: bool, stream_grad: bool,
           before_layer=None) -> bool:
    """A Qwen3 layer stack; returns whether its output requires grad."""
    d, ff, heads, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    tokens, s, base = rows * seq, stream_grad, group.base_trains
    for layer in range(cfg.num_hidden_layers):
        if before_layer is not None:
            s = before_layer(layer, s)
        x = s or base  # the input norm's weight trains in full mode
        q = group.linear(tally, part, "q_proj", tokens, d, heads * hd, x)
        k = group.linear(tally, part, "k_proj", tokens, d, kv * hd, x)
        v = group.linear(tally, part, "v_proj", tokens, d, kv * hd, x)
        attended = tally.attention(part, rows, heads, hd, seq, seq, causal=causal, grads=(q, k, v))
        s = group.linear(tally, part, "o_proj", tokens, heads * hd, d, attended) or s
        if _is_sparse(cfg, layer):
            s = _experts(tally, part, cfg, group, tokens, s or base) or s
        else:
            s = _mlp(tally, part, group, tokens, d, ff, s or base) or s
    return s


def _is_sparse(cfg, layer: int) -> bool:
    """Whether a Qwen3-MoE layer's MLP is its sparse expert block (transformers' rule)."""
    experts = getattr(cfg, "num_experts", 0) or 0
    return (experts > 0 and layer not in (getattr(cfg, "mlp_only_layers", None) or [])
            and (layer + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0)


def _experts(tally: _Tally, part: str, cfg, group: _Group, tokens: int, x: bool) -> bool:
    """The router over every token, then each token through its top-k experts only (the active parameters).

    Expert LoRA (PEFT's target_parameters) adds W + B·A to every expert's weight before the tokens see it: that
    delta's products count once per expert, and the merged weight needs its gradient over the routed tokens."""
    d, ff, experts, top_k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    routed = tokens * top_k
    rank = group.lora.get(EXPERTS)
    weight_grad = group.base_trains or bool(rank and group.lora_trains)
    tally.matmul(part, tokens, d, experts, x, group.base_trains)  # router logits; scales the experts' outputs
    if rank:
        for d_out, d_in in ((2 * ff, d), (d, ff)):  # gate_up (E, 2I, H) and down (E, H, I): B (d_out, r) · A (r, d_in)
            tally.matmul(part, experts * d_out, rank, d_in, group.lora_trains, group.lora_trains)
    hidden = tally.matmul(part, routed, d, 2 * ff, x, weight_grad)
    return tally.matmul(part, routed, ff, d, hidden, weight_grad) or x


def _mlp(tally: _Tally, part: str, group: _Group, tokens: int, d: int, ff: int, x: bool) -> bool:
    gate = group.linear(tally, part, "gate_proj", tokens, d, ff, x)
    up = group.linear(tally, part, "up_proj", tokens, d, ff, x)
    return group.linear(tally, part, "down_proj", tokens, ff, d, gate or up)


def _gca_block(tally: _Tally, block, group: _Group, rows: int, seq: int, memory: tuple[int, int, bool],
               stream_grad: bool) -> bool:
    """q/o over the decoder's tokens, k/v over the memory's (per layer), attention T × M, the optional MLP."""
    mem_rows, mem_len, mem_grad = memory
    d, heads, kv, hd = block.q_proj.in_features, block.num_heads, block.num_kv_heads, block.head_dim
    gates_train = group.mode in ("full", "lora")
    x = stream_grad or group.base_trains
    q = group.linear(tally, "gca", "q_proj", rows * seq, d, heads * hd, x)
    k = group.linear(tally, "gca", "k_proj", mem_rows * mem_len, d, kv * hd, mem_grad)
    v = group.linear(tally, "gca", "v_proj", mem_rows * mem_len, d, kv * hd, mem_grad)
    attended = tally.attention("gca", rows, heads, hd, seq, mem_len, causal=False, grads=(q, k, v))
    s = group.linear(tally, "gca", "o_proj", rows * seq, heads * hd, d, attended) or gates_train or stream_grad
    if block.mlp is not None:
        ff = block.mlp.intermediate_size
        s = _mlp(tally, "gca", group, rows * seq, d, ff, s or group.base_trains) or gates_train or s
    return s


def _groups(model: nn.Module) -> dict[str, _Group]:
    """Each group's train mode and LoRA rank per target, read off the modules themselves."""
    modes, plan = trainable_modes(model), LoraPlan.of(model)
    groups = {}
    for name in ("decoder", "encoder", "gca"):
        settings = getattr(plan, name) if plan else None
        groups[name] = _Group(modes[name], dict.fromkeys(settings.targets, settings.rank) if settings else {})
    return groups


def _approx_6nt(model: nn.Module, decoder_tokens: int, memory_tokens: int, encoded: bool) -> float:
    def without_embeddings(module: nn.Module) -> int:
        return sum(p.numel() for n, p in module.named_parameters() if "embed_tokens" not in n)

    decoder = model.decoder
    n_decoder = without_embeddings(decoder)
    if memory_tokens:
        n_decoder += sum(p.numel() for p in model.memory_projection.parameters())
    else:  # the GCA blocks do not run
        n_decoder -= sum(p.numel() for n, p in decoder.named_parameters() if ".cross_attention." in n)
    if decoder.config.tie_word_embeddings:
        n_decoder += decoder.get_output_embeddings().weight.numel()  # the LM head, listed once as the embedding
    n_encoder = without_embeddings(model.memory_encoder) if encoded else 0
    return 6.0 * n_decoder * decoder_tokens + 6.0 * n_encoder * memory_tokens


def flop_counter(**kwargs) -> _counter.FlopCounterMode:
    """torch's FlopCounterMode, counting fused SDPA backward by this module's convention (the four gradient
    products, not the scores the kernel recomputes: that is hardware work, HFU) and knowing the CPU flash kernel,
    which it otherwise skips. Attention is still counted dense (all pairs, whatever the mask): compare with
    training_flops(causal="full"). With gradient checkpointing it also counts the recomputed forward."""
    aten = torch.ops.aten
    fused_backward = [aten._scaled_dot_product_efficient_attention_backward,
                      aten._scaled_dot_product_flash_attention_backward,
                      aten._scaled_dot_product_cudnn_attention_backward,
                      aten._scaled_dot_product_flash_attention_for_cpu_backward]
    fused_forward = [aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
                     aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_for_cpu]
    mapping = {op: _sdpa_backward_without_recompute for op in fused_backward}
    mapping.update({op: _sdpa_forward for op in fused_forward})
    mapping[aten._grouped_mm] = _grouped_mm  # transformers' Qwen3-MoE experts (grouped_mm), which it leaves out
    return _counter.FlopCounterMode(display=False, custom_mapping=mapping, **kwargs)


def _grouped_mm(a_shape, b_shape, *args, **kwargs) -> int:
    """One product per group: (M, K) x (G, K, N) over groups of M's rows (the experts' forward and input
    gradient), (K, M) x (M, N) -> (G, K, N) over groups of M (their weight gradient), or (G, M, K) x (G, K, N)."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    return 2 * a_shape[-2] * a_shape[-1] * b_shape[-1]  # (G, M, K) x (K, N): not used by transformers


def _query_heads(query_shape, shape) -> tuple[int, ...]:
    """A key or value shape with the query's head count: GQA counted as the kernel computes it (torch < 2.13's
    formulas assert on grouped heads; seen with torch 2.11 on an H200, 2026-11-26)."""
    return (shape[0], query_shape[1], *shape[2:])


def _sdpa_forward(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    key_shape, value_shape = _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape)
    return _counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_without_recompute(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    key_shape, value_shape = _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape)
    b, heads, q_len, head_dim = query_shape
    scores = 2 * b * heads * q_len * key_shape[2] * head_dim
    return _counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape) - scores
