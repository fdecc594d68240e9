"""Loading decoders and encoders from local Hugging Face checkpoint directories (never from a hub)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, Qwen3ForCausalLM, Qwen3Model, Qwen3MoeForCausalLM
from transformers.integrations import is_deepspeed_zero3_enabled

from models.quantization import compute_dtype, keep_cpu_path_exact, quantization_config

DECODER_CLASSES = {"qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}
ENCODER_CLASSES = {"qwen3": Qwen3Model}


def check_checkpoint_dir(path: str | Path, role: str) -> Path:
    """A local directory with config.json and safetensors weights, or a clear error naming what to do."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"{role} checkpoint directory {str(path)!r} does not exist: pass a local directory holding config.json "
            f"and *.safetensors (e.g. from `huggingface-cli download Qwen/Qwen3-0.6B --local-dir DIR`), or set "
            f"AWARENESS_CHECKPOINT_ROOT for the pairs; this pipeline never downloads"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{role} checkpoint {str(path)!r} has no config.json: "
                                "is it a Hugging Face checkpoint directory?")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{role} checkpoint {str(path)!r} has no *.safetensors weights; convert .bin/.pt weights to safetensors "
            f"(this pipeline does not unpickle weights)"
        )
    return path


def load_config(path: str | Path, role: str, supported: dict):
    path = check_checkpoint_dir(path, role)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    if config.model_type not in supported:
        raise ValueError(
            f"{role} checkpoint {str(path)!r} is a {config.model_type!r} model; supported: {sorted(supported)}"
        )
    return config


def load_decoder(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 quantize: str = "none"):
    """Qwen3ForCausalLM or Qwen3MoeForCausalLM from a local checkpoint, through transformers' own loading;
    `quantize` nf4 | int8 loads its linears through bitsandbytes (models.quantization)."""
    config = load_config(path, "decoder", DECODER_CLASSES)
    cls = DECODER_CLASSES[config.model_type]
    return keep_cpu_path_exact(cls.from_pretrained(path, use_safetensors=True, local_files_only=True,
                                                   trust_remote_code=False, attn_implementation="sdpa",
                                                   **_placement(dtype, device, quantize)))


def load_encoder(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                 quantize: str = "none") -> Qwen3Model:
    """Qwen3Model from a Qwen3-Embedding (or any Qwen3) checkpoint; a causal-LM checkpoint loads without its head."""
    load_config(path, "encoder", ENCODER_CLASSES)
    return keep_cpu_path_exact(Qwen3Model.from_pretrained(path, use_safetensors=True, local_files_only=True,
                                                          trust_remote_code=False, attn_implementation="sdpa",
                                                          **_placement(dtype, device, quantize)))


def _placement(dtype: torch.dtype | None, device: str | torch.device, quantize: str) -> dict:
    """from_pretrained's dtype, device map and quantization config. A quantized load names its dtype (the 4-bit
    matmuls' compute dtype and the packed weights' container, which ZeRO-3 flattens with the other parameters);
    transformers never builds it inside zero.Init, so each rank loads it whole and deepspeed.initialize partitions
    it after."""
    if quantize == "none":
        return {"dtype": dtype or "auto", "device_map": _device_map(device)}
    dtype = dtype or compute_dtype(device)
    return {"dtype": dtype, "device_map": _device_map(device),  # None under ZeRO-3: bitsandbytes' current device
            "quantization_config": quantization_config(quantize, dtype)}


def _device_map(device: str | torch.device) -> str | torch.device | None:
    """None while transformers' DeepSpeed ZeRO-3 integration is on: zero.Init puts each rank's partitions on the
    engine's device, and transformers refuses a device_map there."""
    return None if is_deepspeed_zero3_enabled() else device
