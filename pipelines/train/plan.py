"""Will a pair train on a given cluster, and under which ZeRO stage? A per-GPU memory plan from meta-device
parameter counts.

ZeRO-3 in bf16: every parameter is partitioned over all GPUs (2 B each); a trained parameter also carries a bf16
gradient and fp32 master weights plus Adam's two moments (2 + 12 B), the 12 B on CPU with optimizer offload. On top:
the gathered working set (the largest layer, or Qwen3-MoE's whole sparse block, which is a ZeRO-3 leaf), activations,
and one chunk of logits (models/loss.py never holds the whole (B, T, V) block). ZeRO-2 keeps every parameter whole
on every GPU and partitions only the gradients and optimizer states: no gathers at every layer of every step, which
is what a LoRA run with a frozen base pays under ZeRO-3. With no stage given the plan takes ZeRO-2 where it fits and
ZeRO-3 where it does not. DeepSpeed's own ZeRO-3 estimator is shown beside ours when the whole model trains, the case
it models.

Loading has its own peak (`load_peak`), and a run fits only if the larger of the two does.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from models import PAIRS, LoraPlan, LoraSettings, apply_lora, build_pair
from models.fusion import FUSIONS
from models.kernels import liger_available
from models.loss import CHUNK_TOKENS
from models.quantization import QUANTIZE, quantized_bytes, quantized_linears
from models.trainable import ATTENTION, EXPERTS, MLP, is_added_parameter
from pipelines.train.configs.common import OPTIMIZERS

GIB = 1024**3
# CUDA context and NCCL buffers, outside the allocator (2.06-2.21 GiB: proto1, H100, Nov 26 2026)
CUDA_CONTEXT_GIB = 2.0
# The caching allocator reserves beyond the live tensors' peak (blocks split and cached): 11.8% for proto1's
# training steps on an H100 (24.25 GiB reserved at a 21.69 GiB allocated peak, Nov 26 2026); 1.4% while loading.
ALLOCATOR_SLACK = 0.12


@dataclass
class PlanInput:
    pair: str = "tiny"  # a name from models.PAIRS
    nodes: int = 1  # GPU nodes
    gpus_per_node: int = 8  # GPUs per node (ZeRO-3 partitions over nodes x gpus_per_node)
    gpu_memory_gib: float = 80.0  # each GPU's memory
    decoder: str = "lora"  # frozen | lora | full
    encoder: str = "frozen"  # frozen | lora | full
    lora_rank: int = 16  # LoRA rank of the lora parts
    lora_targets: tuple[str, ...] = ATTENTION + MLP  # add experts for LoRA on an MoE pair's experts
    micro_batch: int = 1  # sequences per GPU per micro-step
    memories: int | None = None  # memories per GPU per micro-step (several questions can share one); None: one each
    seq_len: int = 4096  # decoder tokens per sequence
    memory_tokens: int = 16384  # memory tokens per memory (chunks x chunk length)
    gradient_checkpointing: bool = True  # recompute activations in the backward pass
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU memory
    offload_params: bool = False  # ZeRO-3 parameter offload to CPU memory
    fusion: str = "gca"  # gca | cross | merged: how the decoder reads the memory (cross adds a block to every layer)
    zero_stage: int | None = None  # ZeRO stage 0-3; None: 2 where the whole pair fits each GPU, else 3
    quantize: str = "none"  # none | nf4 | int8: the frozen base's linears in that many bits (model.quantize)
    optimizer: str = "adamw"  # adamw | adamw_8bit: Adam's moments in fp32 or 8 bits (train.optimizer)
    fused_loss: bool = False  # Liger's fused linear cross-entropy (model.liger on GPU) instead of models/loss.py's

    def problems(self) -> list[str]:
        p = [] if self.nodes > 0 and self.gpus_per_node > 0 else ["nodes and gpus_per_node must be positive"]
        if self.zero_stage not in (None, 0, 1, 2, 3):
            p.append(f"zero_stage must be 0-3 (or omitted: the plan chooses), got {self.zero_stage}")
        if self.offload_params and self.zero_stage not in (None, 3):
            p.append("offload_params needs zero_stage 3")
        if self.quantize not in QUANTIZE or self.optimizer not in OPTIMIZERS:
            p.append(f"quantize must be one of {QUANTIZE} and optimizer one of {OPTIMIZERS}, got {self.quantize!r} "
                     f"and {self.optimizer!r}")
        elif self.quantize != "none" and "full" in (self.decoder, self.encoder):
            p.append(f"quantize {self.quantize} freezes the base weights: train them with lora, or quantize none")
        if self.fusion not in FUSIONS:
            p.append(f"fusion must be one of {FUSIONS}, got {self.fusion!r}")
        if self.pair not in PAIRS:
            return p + [f"pair {self.pair!r} is not one of {sorted(PAIRS)}"]
        if EXPERTS in self.lora_targets and PAIRS[self.pair].decoder_config["model_type"] != "qwen3_moe":
            p.append(f"lora_targets: {EXPERTS} is LoRA on Qwen3-MoE experts, and pair {self.pair} is dense")
        return p


@dataclass
class MemoryPlan:
    inputs: PlanInput
    params: dict[str, int]
    rows: dict[str, float] = field(default_factory=dict)  # GiB per GPU
    cpu_gib_per_node: float = 0.0
    deepspeed_estimate_gib: float | None = None
    load_rows: dict[str, float] = field(default_factory=dict)  # GiB per GPU while the pair is built (load_peak)
    load_host_gib: dict[str, float] = field(default_factory=dict)  # GiB of host memory per node while loading
    zero_stage: int = 3  # the stage planned: the one given, or the plan's choice
    zero_reason: str = ""  # why that stage

    @property
    def total_gib(self) -> float:
        """The training peak per GPU."""
        return sum(self.rows.values())

    @property
    def load_gib(self) -> float:
        return sum(self.load_rows.values())

    @property
    def peak_gib(self) -> float:
        return max(self.total_gib, self.load_gib)

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.inputs.gpu_memory_gib

    def table(self) -> str:
        i = self.inputs
        lines = [f"ZeRO-{self.zero_stage}: {self.zero_reason}",
                 f"pair {i.pair}: {i.nodes} node(s) x {i.gpus_per_node} GPU(s) of {i.gpu_memory_gib:.0f} GiB, "
                 f"decoder {i.decoder}, encoder {i.encoder}, LoRA rank {i.lora_rank}, sequence {i.seq_len}, "
                 f"memory {i.memory_tokens} tokens, micro-batch {i.micro_batch}, quantize {i.quantize}, "
                 f"optimizer {i.optimizer}",
                 "parameters: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in self.params.items()),
                 f"| {'per GPU':<44} | {'GiB':>8} |", f"|{'-' * 46}|{'-' * 10}|"]
        lines += [f"| {name:<44} | {gib:8.2f} |" for name, gib in self.rows.items()]
        lines.append(f"| {'total while training':<44} | {self.total_gib:8.2f} |")
        if self.load_rows:
            building = "quantized load" if i.quantize != "none" else "zero.Init build"
            lines += [f"| {f'loading ({building}), per GPU':<44} | {'GiB':>8} |", f"|{'-' * 46}|{'-' * 10}|"]
            lines += [f"| {name:<44} | {gib:8.2f} |" for name, gib in self.load_rows.items()]
            lines.append(f"| {'total while loading':<44} | {self.load_gib:8.2f} |")
        else:
            lines.append("loading: in host memory; DeepSpeed's start moves the pair to each GPU (the training rows)")
        lines += [f"host memory while loading, {name}: {gib:.1f} GiB" for name, gib in self.load_host_gib.items()]
        if self.deepspeed_estimate_gib is not None:
            lines.append("DeepSpeed's ZeRO-3 estimate of model states (full training): "
                         f"{self.deepspeed_estimate_gib:.2f} GiB/GPU")
        if self.cpu_gib_per_node:
            lines.append(f"CPU memory for offloaded states: {self.cpu_gib_per_node:.1f} GiB per node")
        verdict = "fits" if self.fits else "does NOT fit"
        lines.append(f"{verdict}: peak {self.peak_gib:.1f} (training {self.total_gib:.1f}, "
                     f"loading {self.load_gib:.1f}) of {i.gpu_memory_gib:.0f} GiB per GPU")
        return "\n".join(lines)


def plan_for_stage(config) -> MemoryPlan:
    """The plan of a stage config's GPU run: its pair, train modes, workers and (for stage 0's needles) lengths."""
    spec, s, d = config.needle.spec(), config.scaling, config.data
    per_gpu_memories = max(1, config.train.memories_per_step // (s.num_workers * config.train.grad_accum))
    if d.train_path:  # corpus rows: packed to data.max_tokens, one memory of max_chunks x chunk_len each
        questions, seq_len, memory_tokens = 1, d.max_tokens, d.max_chunks * d.chunk_len
    else:
        # the longest question row of the mixture, and the largest memory (needle.memory_scale_max)
        questions, seq_len = spec.questions, spec.longest_row
        memory_tokens = spec.chunks * spec.memory_scale_max * spec.chunk_len
    return plan_memory(PlanInput(
        pair=config.model.pair, nodes=max(1, -(-s.num_workers // s.gpus_per_node)),
        gpus_per_node=min(s.num_workers, s.gpus_per_node), gpu_memory_gib=s.gpu_memory_gib,
        decoder=config.model.decoder, encoder=config.model.encoder, lora_rank=config.model.lora_rank,
        lora_targets=tuple(config.model.lora_targets), micro_batch=per_gpu_memories * questions,
        memories=per_gpu_memories, seq_len=seq_len, memory_tokens=memory_tokens,
        gradient_checkpointing=config.model.gradient_checkpointing,
        offload_optimizer=config.deepspeed.offload_optimizer, offload_params=config.deepspeed.offload_params,
        fusion=config.model.fusion, zero_stage=config.deepspeed.zero_stage, quantize=config.model.quantize,
        optimizer=config.train.optimizer, fused_loss=uses_liger(config),
    ))


def measured_peak_gib() -> float | None:
    """This process's GPU peak as the plan counts it: the allocator's peak reservation plus what the device holds
    outside the allocator now (CUDA context, NCCL buffers); None without CUDA. A training job reports it beside the
    plan's prediction."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (torch.cuda.max_memory_reserved() + total - free - torch.cuda.memory_reserved()) / GIB


def uses_liger(config) -> bool:
    """model.liger, or by default: on GPU workers where Liger-Kernel is installed (pipelines.train.recipes.stage)."""
    if config.model.liger is not None:
        return config.model.liger
    return config.scaling.use_gpu and liger_available()


def count_parameters(inputs: PlanInput) -> tuple[dict[str, int], int, object]:
    """Parameter counts by role from the real architecture on the meta device, plus the largest gathered unit.
    Decoder LoRA is counted by injecting it there (apply_lora, no memory), so its shapes are PEFT's own. The model
    comes back too, LoRA and all (its modules size the activations and the load peak): read it, never change it."""
    params, largest, model = _count_parameters(inputs.pair, inputs.fusion, inputs.decoder == "lora", inputs.lora_rank,
                                               tuple(inputs.lora_targets))
    return dict(params), largest, model


@functools.lru_cache(maxsize=8)  # plans that differ only in bits, optimizer or hardware share one meta model
def _count_parameters(pair: str, fusion: str, decoder_lora: bool, lora_rank: int,
                      lora_targets: tuple[str, ...]) -> tuple[dict[str, int], int, object]:
    model = build_pair(pair, device="meta", fusion=fusion)
    if decoder_lora:
        apply_lora(model, LoraPlan(decoder=LoraSettings(rank=lora_rank, targets=lora_targets)))
    decoder = sum(p.numel() for n, p in model.decoder.named_parameters() if not is_added_parameter(n))
    encoder = sum(p.numel() for p in model.memory_encoder.parameters())
    added = sum(p.numel() for n, p in model.named_parameters() if is_added_parameter(n) and "lora_" not in n)
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    largest = max(sum(p.numel() for p in layer.parameters()) for layer in model.decoder.model.layers)
    params = {"decoder": decoder, "encoder": encoder, "gca+projection": added}
    if lora:
        params["decoder LoRA"] = lora
    return params, largest, model


def plan_memory(inputs: PlanInput) -> MemoryPlan:
    """The plan under `inputs.zero_stage`, or under the stage the plan chooses: ZeRO-2 where the whole pair, its
    gradients' and optimizer's partitions and the activations fit each GPU (nothing gathered at every step), else
    ZeRO-3 (also whenever parameters are offloaded, which only ZeRO-3 does)."""
    counted = count_parameters(inputs)
    if inputs.zero_stage is not None:
        return _plan_at(inputs, inputs.zero_stage, counted, "as configured")
    if inputs.offload_params:
        return _plan_at(inputs, 3, counted, "chosen: parameter offload needs ZeRO-3")
    whole = _plan_at(inputs, 2, counted, "")
    if whole.fits:
        pair_gib = whole.rows[parameter_row(inputs.quantize, 2)]
        whole.zero_reason = (f"chosen: the whole pair ({pair_gib:.1f} GiB) fits each GPU, "
                             f"so only gradients and optimizer states are partitioned (peak {whole.peak_gib:.1f} of "
                             f"{inputs.gpu_memory_gib:.0f} GiB)")
        return whole
    return _plan_at(inputs, 3, counted, f"chosen: under ZeRO-2 the peak would be {whole.peak_gib:.1f} GiB of "
                                        f"{inputs.gpu_memory_gib:.0f}, so parameters are partitioned too")




def _plan_at(inputs: PlanInput, stage: int, counted: tuple[dict[str, int], int, object], reason: str) -> MemoryPlan:
    params, largest, model = counted
    n_gpus = inputs.nodes * inputs.gpus_per_node
    trained = params["gca+projection"] + params.get("decoder LoRA", 0)
    trained += params["decoder"] if inputs.decoder == "full" else 0
    trained += params["encoder"] if inputs.encoder == "full" else 0
    total = sum(params.values())
    plan = MemoryPlan(inputs, params, zero_stage=stage, zero_reason=reason)
    sizes = parameter_bytes(model, inputs.quantize)
    weight_bytes = sum(sizes.values())  # 2 * total in bf16
    on_gpu_param_bytes = 0 if inputs.offload_params else weight_bytes
    plan.rows[parameter_row(inputs.quantize, stage)] = on_gpu_param_bytes / (n_gpus if stage == 3 else 1) / GIB
    plan.rows["gradients of trained parameters (bf16)"] = 2 * trained / (n_gpus if stage >= 2 else 1) / GIB
    optimizer_bytes = OPTIMIZER_BYTES[inputs.optimizer] * trained / (n_gpus if stage >= 1 else 1)
    if inputs.offload_optimizer:
        plan.cpu_gib_per_node = 12 * trained / inputs.nodes / GIB
    else:
        plan.rows[OPTIMIZER_ROWS[inputs.optimizer]] = optimizer_bytes / GIB
    if inputs.offload_params:
        plan.cpu_gib_per_node += weight_bytes / inputs.nodes / GIB
    if stage == 3:
        largest_bytes = max(sum(sizes[id(p)] for p in layer.parameters()) for layer in model.decoder.model.layers)
        plan.rows["gathered working set (2 largest layers)"] = 2 * largest_bytes / GIB
    if inputs.decoder == "lora" and EXPERTS in inputs.lora_targets:
        plan.rows["expert weights with LoRA folded in"] = expert_lora_bytes(inputs, model) / GIB
    plan.rows |= activation_rows(inputs, model)
    plan.rows["allocator's cached slack (12% of the above)"] = ALLOCATOR_SLACK * sum(plan.rows.values())
    plan.rows["CUDA context, NCCL"] = CUDA_CONTEXT_GIB
    if inputs.quantize != "none":
        plan.load_rows, plan.load_host_gib = quantized_load_peak(inputs, params, model, sizes)
    else:
        plan.load_rows, plan.load_host_gib = load_peak(inputs, params, model)
        if stage < 3:  # every rank builds the whole pair in host memory; DeepSpeed's start moves it to the GPU,
            # where the training rows already count it: no GPU peak of its own (measured on an H200: 0.5 GiB)
            plan.load_rows = {}
            plan.load_host_gib[f"every node ({inputs.gpus_per_node} ranks, each the whole pair in bf16)"] = (
                inputs.gpus_per_node * 2 * (total - params.get("decoder LoRA", 0)) / GIB)
    if inputs.decoder == "full" and inputs.encoder == "full" and stage == 3:
        # lazy: DeepSpeed; every stage job's --dry-run prints this plan, and only this row needs it
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            total, largest, inputs.gpus_per_node, inputs.nodes, cpu_offload=inputs.offload_optimizer,
            cpu_offload_params=inputs.offload_params)
        plan.deepspeed_estimate_gib = gpu / GIB
    return plan


def load_peak(inputs: PlanInput, params: dict[str, int], model) -> tuple[dict[str, float], dict[str, float]]:
    """Memory while a ZeRO-3 worker builds the pair (pipelines.train.engine.zero3_loading), read from transformers
    5.23's loading code: per GPU, and host memory per node.

    GPU: each module is constructed whole inside zero.Init and partitioned when its constructor returns; then
    `_load_state_dict_into_zero3_model` walks the modules and, for each, gathers that module's own parameters
    (not its children's) on every rank, copies the checkpoint values in on rank 0, broadcasts and re-partitions.
    So at any time a GPU holds the partitions built so far (at most all of them, bf16, on CPU with offload_params)
    plus one module's parameters in full: the largest module, an embedding or a Qwen3-MoE layer's fused experts.

    Host: only global rank 0 reads values (the other ranks build meta tensors from the shard headers). It maps
    every safetensors shard of the checkpoint it loads (the encoder's, then the decoder's; one is released before
    the next) and touches every page as it copies: file-backed page cache, the largest checkpoint's size, on the
    node of rank 0. Qwen3-MoE checkpoints store one tensor per expert, which transformers stacks into the fused
    weights one layer at a time: that layer's experts as new host memory on rank 0. The assumption: the checkpoints
    are bf16 (as Qwen's are), and the page cache holds the mapped shards until the load ends (nothing evicts them).
    The processes' own baseline (Python, torch, CUDA libraries, a few GiB each) is not counted."""
    n_gpus = inputs.nodes * inputs.gpus_per_node
    total = sum(params.values()) - params.get("decoder LoRA", 0)  # LoRA is added after the build
    modules = [m for m in model.modules() if not type(m).__name__.startswith("Lora")]
    largest = max(sum(p.numel() for n, p in m.named_parameters(recurse=False) if "lora_" not in n) for m in modules)
    rows = {"partitions of every parameter (bf16)": 0.0 if inputs.offload_params else 2 * total / n_gpus / GIB,
            "one module gathered whole (largest)": 2 * largest / GIB,
            "CUDA context, NCCL": CUDA_CONTEXT_GIB}
    checkpoint = 2 * max(params["decoder"], params["encoder"])
    experts = max((sum(p.numel() for n, p in layer.named_parameters() if ".experts." in n and "lora_" not in n)
                   for layer in model.decoder.model.layers), default=0)
    host = {"node of rank 0 (mapped checkpoint shards)": checkpoint / GIB}
    if experts:
        host["node of rank 0 (one MoE layer's experts stacked)"] = 2 * experts / GIB
    if inputs.nodes > 1:
        host["other nodes (shard headers only)"] = 0.0
    return rows, host


def expert_lora_bytes(inputs: PlanInput, model) -> int:
    """PEFT applies expert LoRA by building W + B@A for all of a layer's experts at each forward (bf16); the
    grouped matmul keeps that copy for backward, which also builds its gradient. With checkpointing one layer's
    copy and gradient are alive at a time, without it every layer's copy waits for backward."""
    layers = model.decoder.model.layers
    per_layer = max(sum(p.numel() for n, p in layer.named_parameters() if ".experts." in n and "lora_" not in n)
                    for layer in layers)
    copies = 2 if inputs.gradient_checkpointing else len(layers) + 1
    return 2 * copies * per_layer


def activation_rows(inputs: PlanInput, model) -> dict[str, float]:
    """bf16 activations kept for backward, per GPU (SDPA/flash: no s^2 attention scores are stored)."""
    d = model.decoder.config
    b, s, m, h, layers = inputs.micro_batch, inputs.seq_len, inputs.memory_tokens, d.hidden_size, d.num_hidden_layers
    bm = inputs.memories or b  # memories: the memory-side terms scale with these, not with the questions
    per_layer_full = 34 * b * s * h  # Korthikanti et al. (2022), bf16, without the s^2 term
    if getattr(d, "num_experts", None):
        per_layer_full += 2 * 3 * b * s * d.num_experts_per_tok * d.moe_intermediate_size
    if inputs.gradient_checkpointing:
        decoder = layers * 2 * b * s * h + per_layer_full  # layer inputs, plus one layer recomputed at a time
    else:
        decoder = layers * per_layer_full
    n_gca = len(model.gca_layers)
    kv = d.num_key_value_heads * d.head_dim
    # queries/outputs, memory K/V, projected memory
    gca = n_gca * (12 * b * s * h + 2 * 2 * bm * m * kv) + 2 * bm * m * h
    encoder_h = model.memory_encoder.hidden_size
    encoder_layers = model.memory_encoder.encoder.config.num_hidden_layers
    encoder = 2 * bm * m * encoder_h * (1 if inputs.encoder == "frozen" else encoder_layers * 17)
    rows = {
        "decoder activations": decoder / GIB,
        "GCA activations and memory K/V": gca / GIB,
        "memory encoder states": encoder / GIB,
    }
    if inputs.fused_loss:
        rows["logits and loss (Liger's fused chunks)"] = fused_loss_bytes(b * s, h, d.vocab_size) / GIB
    else:
        # one chunk of models/loss.py's logits at a time: bf16 logits (2 B), the loss's fp32 log-softmax (4 B) and,
        # in its backward, the fp32 gradients coming in and going out (4 + 4 B)
        rows["logits and loss (one chunk, fp32 upcast)"] = 14 * min(b * s, CHUNK_TOKENS) * d.vocab_size / GIB
    return rows


def fused_loss_bytes(tokens: int, hidden: int, vocab: int) -> int:
    """Liger's fused linear cross-entropy: one chunk of bf16 logits at a time, its gradient written in place, chunks
    of as many tokens as make a chunk the size of the hidden states (Liger's own rule), and the hidden states'
    gradient (bf16) filled in during the forward."""
    chunk = 1 << max(0, math.ceil(tokens / math.ceil(vocab / hidden)) - 1).bit_length()
    return 2 * chunk * vocab + 2 * tokens * hidden


# Bytes per trained parameter in the optimizer: DeepSpeed's fp32 master copy (4 B) and Adam's two moments, in fp32
# (8 B) or blockwise-quantized to 8 bits (2 B; one fp32 absmax per 2,048 values is below the rounding here).
OPTIMIZER_BYTES = {"adamw": 12, "adamw_8bit": 6}
OPTIMIZER_ROWS = {"adamw": "fp32 master + Adam moments (partitioned)",
                  "adamw_8bit": "fp32 master + 8-bit Adam moments"}
WEIGHTS = {"none": "bf16", "nf4": "NF4 base linears", "int8": "int8 base linears"}


def parameter_row(quantize: str, stage: int) -> str:
    """The parameters' row: their precision, and whether ZeRO-3 partitions them or each GPU holds them whole."""
    return f"parameters ({WEIGHTS[quantize]}, {'ZeRO-3 partitioned' if stage == 3 else 'whole on each GPU'})"


def parameter_bytes(model, quantize: str) -> dict[int, float]:
    """Bytes each parameter of the meta model takes on a GPU, by id: bf16, except the base linears bitsandbytes
    converts (transformers' rule, models.quantization.quantized_linears), at their quantized size. Qwen3-MoE's experts
    are not linears and stay bf16."""
    sizes = {id(p): 2.0 * p.numel() for p in model.parameters()}
    if quantize != "none":
        for base in (model.decoder, model.memory_encoder.encoder):
            for name in quantized_linears(base):
                if ".cross_attention." not in name:  # added after loading, in full precision
                    linear = base.get_submodule(name)
                    sizes[id(linear.weight)] = quantized_bytes(linear, quantize)
    return sizes


def quantized_load_peak(inputs: PlanInput, params: dict[str, int], model,
                        sizes: dict[int, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Memory while a worker loads a quantized pair (pipelines.train.model.quantized_loading). transformers does not
    build a quantized model inside zero.Init, so every rank loads the whole pair onto its GPU, each tensor read in
    bf16 and quantized as it arrives; deepspeed.initialize partitions it after (ZeRO-3). Every rank reads the
    checkpoints itself: page cache of the larger checkpoint on each node, shared by the node's ranks."""
    whole = sum(sizes[id(p)] for n, p in model.named_parameters() if "lora_" not in n)  # LoRA comes after the load
    modules = [m for m in model.modules() if not type(m).__name__.startswith("Lora")]
    largest = max(sum(p.numel() for n, p in m.named_parameters(recurse=False) if "lora_" not in n) for m in modules)
    rows = {f"the whole pair, base linears {inputs.quantize} (every GPU)": whole / GIB,
            "largest tensor in bf16 before quantizing": 2 * largest / GIB,
            "CUDA context, NCCL": CUDA_CONTEXT_GIB}
    checkpoint = 2 * max(params["decoder"], params["encoder"])
    return rows, {"every node (mapped checkpoint shards, shared by its ranks)": checkpoint / GIB}


# The seed plan's hardware for each real pair (qwen3-gca-plan.md, 3.1): (nodes, GPUs per node, GiB each, the GPUs).
SEED_HARDWARE = {"proto1": (1, 1, 12.0, "1x RTX 3060"), "proto2": (1, 1, 16.0, "1x RTX 4060 Ti"),
                 "dev": (1, 1, 24.0, "1x RTX 4090"), "scale": (1, 1, 40.0, "1x A100-40G"),
                 "prod": (1, 2, 24.0, "2x RTX 4090")}
SEED_SETTINGS = {"bf16": {}, "nf4": {"quantize": "nf4"},
                 "nf4 + adamw_8bit": {"quantize": "nf4", "optimizer": "adamw_8bit"},
                 "bf16, parameters offloaded": {"offload_params": True}}


def seed_hardware_plans(**overrides) -> dict[str, dict[str, MemoryPlan]]:
    """Each seed pair's plan on its seed hardware (ZeRO-3, decoder LoRA, frozen encoder, PlanInput's sequence and
    memory lengths unless overridden) in each of SEED_SETTINGS: 16-bit, NF4, NF4 with 8-bit Adam, and 16-bit with
    ZeRO-3's parameter offload to CPU memory."""
    overrides = {"zero_stage": 3, **overrides}
    return {pair: {label: plan_memory(PlanInput(pair=pair, nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=gib,
                                                **setting, **overrides))
                   for label, setting in SEED_SETTINGS.items()}
            for pair, (nodes, gpus, gib, _) in SEED_HARDWARE.items()}


def seed_hardware_table(**overrides) -> str:
    """docs/pairs.md's table: peak GiB per GPU (the larger of training and loading) and whether it fits."""
    plans = seed_hardware_plans(**overrides)
    lines = ["| pair | seed hardware | " + " | ".join(SEED_SETTINGS) + " |",
             "|---|---|" + "---:|" * len(SEED_SETTINGS)]
    for pair, by_setting in plans.items():
        cells = [f"{plan.peak_gib:.1f} {'fits' if plan.fits else 'does not fit'}" for plan in by_setting.values()]
        lines.append(f"| {pair} | {SEED_HARDWARE[pair][3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
