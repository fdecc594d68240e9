"""The one place that decides what trains: GCA blocks, decoder, encoder; and PEFT LoRA on each of them."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn

TrainMode = Literal["frozen", "lora", "full"]
TRAIN_MODES = ("frozen", "lora", "full")
ADAPTER_NAME = "default"

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# Module paths of each group inside AwarenessModel (wrapped decoder layers gain a `decoder_layer.` step).
_GROUP_PATTERNS = {
    "decoder": r"decoder\.model\.layers\.\d+\.(?:decoder_layer\.)?(?:self_attn|mlp)\.({targets})",
    "gca": r"decoder\.model\.layers\.\d+\.cross_attention\.(?:mlp\.)?({targets})",
    "encoder": r"memory_encoder\.encoder\.layers\.\d+\.(?:self_attn|mlp)\.({targets})",
}


@dataclass
class LoraSettings:
    """LoRA for one group of modules."""

    rank: int = 16
    alpha: float | None = None  # scaling numerator; None means 2 * rank (the plan's choice)
    dropout: float = 0.0
    targets: tuple[str, ...] = ATTENTION + MLP  # projection names; MoE experts are fused parameters, not matched


@dataclass
class LoraPlan:
    """Which groups get LoRA; each group has its own rank and targets."""

    decoder: LoraSettings | None = field(default_factory=LoraSettings)
    gca: LoraSettings | None = None
    encoder: LoraSettings | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LoraPlan":
        def settings(value):
            return None if value is None else LoraSettings(**{**value, "targets": tuple(value["targets"])})

        return cls(**{group: settings(data.get(group)) for group in ("decoder", "gca", "encoder")})


def lora_config(plan: LoraPlan) -> LoraConfig:
    """One PEFT LoraConfig whose regex targets and rank/alpha patterns give each group its own settings."""
    groups = {g: s for g, s in (("decoder", plan.decoder), ("gca", plan.gca), ("encoder", plan.encoder)) if s}
    if not groups:
        raise ValueError("LoraPlan names no group: set at least one of decoder, gca, encoder")
    patterns = {}
    for group, settings in groups.items():
        if settings.rank <= 0:
            raise ValueError(f"LoRA rank for {group} must be positive, got {settings.rank}")
        unknown = set(settings.targets) - set(ATTENTION + MLP)
        if unknown or not settings.targets:
            raise ValueError(f"LoRA targets for {group} must be a non-empty subset of {ATTENTION + MLP}, got {settings.targets}")
        patterns[group] = _GROUP_PATTERNS[group].format(targets="|".join(map(re.escape, settings.targets)))
    first = next(iter(groups.values()))
    return LoraConfig(
        r=first.rank,
        lora_alpha=_alpha(first),
        lora_dropout=max(s.dropout for s in groups.values()),
        target_modules="|".join(f"(?:{p})" for p in patterns.values()),
        rank_pattern={patterns[g]: s.rank for g, s in groups.items()},
        alpha_pattern={patterns[g]: _alpha(s) for g, s in groups.items()},
        bias="none",
    )


def _alpha(settings: LoraSettings) -> float:
    return settings.alpha if settings.alpha is not None else 2 * settings.rank


def apply_lora(model: nn.Module, plan: LoraPlan) -> LoraConfig:
    """Injects LoRA adapters into `model` in place (PEFT) and records the plan in its config for reloading."""
    if any(isinstance(m, LoraLayer) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters; build a fresh model to apply another plan")
    config = lora_config(plan)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    if hasattr(model, "config"):
        model.config.lora = plan.to_dict()
    for group, settings in (("decoder", plan.decoder), ("gca", plan.gca), ("encoder", plan.encoder)):
        if settings and not any(parameter_group(n) == group and "lora_" in n for n, _ in model.named_parameters()):
            raise ValueError(f"LoRA targets {settings.targets} matched no {group} module")
    return config


def parameter_group(name: str) -> str:
    """'gca' (blocks and projection, what AwarenessModel adds), 'encoder' or 'decoder'."""
    if is_added_parameter(name) and "lora_" not in name or ".cross_attention." in name:
        return "gca"
    if name.startswith("memory_encoder."):
        return "encoder"
    return "decoder"


def is_added_parameter(name: str) -> bool:
    """Parameters that are not in the base checkpoints: GCA blocks, the memory projection, LoRA adapters."""
    return ".cross_attention." in name or name.startswith("memory_projection.") or "lora_" in name


def set_trainable(
    model: nn.Module, *, decoder: TrainMode = "frozen", encoder: TrainMode = "frozen", gca: TrainMode = "full"
) -> dict[str, int]:
    """Sets requires_grad for every parameter and returns the trainable count per group.

    `lora` trains a group's LoRA adapters (for GCA also its gates, which must open); `full` trains its base
    weights (not its adapters); `frozen` trains nothing of it.
    """
    modes = {"decoder": decoder, "encoder": encoder, "gca": gca}
    for group, mode in modes.items():
        if mode not in TRAIN_MODES:
            raise ValueError(f"{group} train mode must be one of {TRAIN_MODES}, got {mode!r}")
    names = dict(model.named_parameters())
    for group, mode in modes.items():
        if mode == "lora" and not any(parameter_group(n) == group and "lora_" in n for n in names):
            raise ValueError(f"{group}={mode!r} needs LoRA adapters: call apply_lora with a {group} LoraSettings first")
    counts = dict.fromkeys(modes, 0)
    for name, param in names.items():
        group = parameter_group(name)
        is_lora = "lora_" in name
        mode = modes[group]
        trains = (mode == "full" and not is_lora) or (
            mode == "lora" and (is_lora or (group == "gca" and name.endswith("gate")))
        )
        param.requires_grad_(trains)
        counts[group] += param.numel() if trains else 0
    if hasattr(model, "config"):
        model.config.trainable = modes
    return counts


@torch.no_grad()
def merged_state_dict(module: nn.Module, *, base_only: bool) -> dict[str, torch.Tensor]:
    """The state dict with LoRA deltas merged into their base weights and PEFT's `.base_layer.` step removed.

    base_only=True gives the base model as transformers names it (wrapped layers unwrapped, GCA left out), so a
    decoder or encoder saves as a plain checkpoint; base_only=False keeps only what AwarenessModel adds.
    """
    deltas = {}
    for name, sub in module.named_modules():
        if isinstance(sub, LoraLayer) and ADAPTER_NAME in sub.lora_A:
            deltas[f"{name}.weight"] = sub.get_delta_weight(ADAPTER_NAME)
    state = {}
    for name, tensor in module.state_dict().items():
        if "lora_" in name or is_added_parameter(name) == base_only:
            continue
        key = name.replace(".base_layer.", ".")
        if key in deltas:
            tensor = tensor + deltas[key].to(tensor.dtype)
        state[key.replace(".decoder_layer.", ".") if base_only else key] = tensor
    return state
