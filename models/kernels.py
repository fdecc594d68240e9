"""Fused GPU kernels for the pair's memory-bound work, from Liger-Kernel (a CUDA-only dependency: its kernels are
Triton), applied the way its documentation says: patch transformers' Qwen3 and Qwen3-MoE modules before the model is
built. RMSNorm (the decoder's four a layer with the QK-norms, the encoder's, the GCA blocks' own, which look their
classes up in transformers' module when built), SwiGLU and RoPE then run fused; the loss is fused in models/loss.py,
not here (the model computes it from hidden states). Nothing changes the weights or their names: checkpoints and
exports load either way.
"""

from __future__ import annotations

import importlib.util

import torch


def liger_available() -> bool:
    """Liger-Kernel installed (the CUDA lock) and a CUDA device to run its Triton kernels on."""
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def use_liger_kernels() -> bool:
    """Patches transformers' Qwen3 and Qwen3-MoE norms, MLPs and RoPE with Liger's, for every model built after
    this call in this process; False (nothing patched) where Liger cannot run."""
    if not liger_available():
        return False
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3, apply_liger_kernel_to_qwen3_moe

    kernels = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
    apply_liger_kernel_to_qwen3(**kernels)
    apply_liger_kernel_to_qwen3_moe(**kernels)
    return True
