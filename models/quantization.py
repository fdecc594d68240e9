"""Frozen base weights in fewer bits (QLoRA): the decoder and encoder load through transformers'
`BitsAndBytesConfig`, and only what AwarenessModel adds and LoRA train, in full precision.

- `nf4`: QLoRA's 4-bit NormalFloat with double quantization (the absmax constants quantized too), stored in the
  compute dtype's container so DeepSpeed ZeRO-3 partitions the packed weights with the rest (PEFT's DeepSpeed
  ZeRO-3 + QLoRA recipe: every parameter of a flattened group must share one dtype).
- `int8`: LLM.int8 (bitsandbytes' Linear8bitLt), for a frozen base that is not partitioned (ZeRO-0 to 2).

transformers converts every `nn.Linear` of a base model but its output embeddings (and tied or last modules);
Qwen3-MoE's experts are 3-D parameters, not `nn.Linear`s, so they stay 16-bit (`quantized_linears` says which).

PEFT's `prepare_model_for_kbit_training` is not applied: of its steps, freezing is `set_trainable`'s, the input-grad
hook and reentrant checkpointing are not needed (AwarenessModel checkpoints non-reentrantly, and a frozen encoder
that only reads needs no gradient at its inputs), and its upcast of every 16-bit parameter to fp32 is undone by
DeepSpeed, which casts the model to its precision at initialize and keeps fp32 masters of what trains; meanwhile the
upcast would double the load peak of what stays 16-bit (Qwen3-30B-A3B's experts: 55 GiB more per GPU).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BitsAndBytesConfig
from transformers.quantizers.base import get_keys_to_not_convert
from transformers.quantizers.quantizers_utils import should_convert_module

from models.specs import QUANTIZE

# Bytes a quantized weight takes: NF4's 4 bits plus one 8-bit absmax per 64-weight block and, with double
# quantization, one fp32 constant per 256 absmaxes (the QLoRA paper's 0.127 bits); int8's byte plus one fp32 scale
# per output row (small beside the row, counted by `quantized_bytes`).
NF4_BLOCK, NF4_DOUBLE_BLOCK = 64, 256
WEIGHT_BITS = {"nf4": 4 + 8 / NF4_BLOCK + 32 / (NF4_BLOCK * NF4_DOUBLE_BLOCK), "int8": 8.0}
CPU_PACK_ROWS = 32  # bitsandbytes' AVX512-BF16 CPU kernel packs 4-bit weights in blocks of this many output rows


def check_quantize(quantize: str) -> str:
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    return quantize


def compute_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on a GPU; fp32 on CPU, where bf16 matmuls are emulated on CPUs without AVX512-BF16/AMX (40x slower than
    fp32 on an AVX2 machine) and the CPU pipeline trains in fp32 anyway (deepspeed.precision auto)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def quantization_config(quantize: str, dtype: torch.dtype) -> BitsAndBytesConfig | None:
    """transformers' bitsandbytes config for `quantize` with matmuls in `dtype`; None for `none`."""
    if check_quantize(quantize) == "none":
        return None
    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


def quantized_linears(model: nn.Module) -> list[str]:
    """Names of the `nn.Linear` modules of a transformers base model that BitsAndBytesConfig loading converts
    (transformers' own rule, so a meta-device model gives a memory plan the same answer as loading does)."""
    skip = get_keys_to_not_convert(model)
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and "lora_" not in name and should_convert_module(name, skip)]


def quantized_bytes(linear: nn.Linear, quantize: str) -> float:
    """Bytes of one converted linear's weight (its bias, if any, stays 16-bit and is not counted here)."""
    weights = linear.in_features * linear.out_features
    rows = linear.out_features if quantize == "int8" else 0
    return weights * WEIGHT_BITS[quantize] / 8 + 4 * rows


def keep_cpu_path_exact(model: nn.Module) -> nn.Module:
    """bitsandbytes' 4-bit inference on CPUs with AVX512-BF16 repacks each weight at its first eval forward and then
    computes in bf16, whatever the compute dtype; it also fails on widths that are not multiples of CPU_PACK_ROWS
    output rows and NF4_BLOCK inputs (a tiny pair's 48-wide encoder). Linears computing in another dtype, or of such
    widths, keep its generic path, so evaluation reads as training computes."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False) and (
                module.compute_dtype != torch.bfloat16 or module.out_features % CPU_PACK_ROWS
                or module.in_features % NF4_BLOCK):
            module.support_avx512bf16_for_cpu = False
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(getattr(m, "is_loaded_in_4bit", False) or getattr(m, "is_loaded_in_8bit", False)
               for m in model.modules())
