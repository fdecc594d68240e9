"""The one place that decides what trains: GCA blocks, decoder, encoder; and PEFT LoRA on each of them."""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer, ParamWrapper
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from models.specs import ATTENTION, EXPERTS, GROUP_TARGETS, MLP, TRAIN_MODES, TrainMode

ADAPTER_NAME = "default"
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


# Module paths of each group inside AwarenessModel (wrapped decoder layers gain a `decoder_layer.` step).
_GROUP_PATTERNS = {
    "decoder": r"decoder\.model\.layers\.\d+\.(?:decoder_layer\.)?(?:self_attn|mlp)\.({targets})",
    "gca": r"decoder\.model\.layers\.\d+\.cross_attention\.(?:mlp\.)?({targets})",
    "encoder": r"memory_encoder\.encoder\.layers\.\d+\.(?:self_attn|mlp)\.({targets})",
}


@dataclass
class LoraSettings:
    """LoRA for one group of modules.

    `targets` are projection names, plus `experts` for a Qwen3-MoE decoder. The default leaves the experts out: on
    an MoE decoder the MLP names match only dense MLP layers (Qwen3-30B-A3B has none), so it means attention-only
    LoRA there. Expert LoRA is opt-in because it is far larger and slower: PEFT gives every expert its own pair, so
    Qwen3-30B-A3B at rank 16 gets 629M adapter parameters (47x its attention LoRA), and each forward folds the
    delta into a full copy of a layer's expert weights. It also allows no dropout (see lora_config).
    """

    rank: int = 16
    alpha: float | None = None  # scaling numerator; None means 2 * rank (the plan's choice)
    dropout: float = 0.0
    targets: tuple[str, ...] = ATTENTION + MLP


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

    @classmethod
    def of(cls, model: nn.Module) -> "LoraPlan | None":
        """The plan of the adapters injected into `model` (PEFT keeps each layer's rank, alpha and dropout), or None
        without LoRA: read off the modules, so nothing beside them has to remember it. Targets are those that
        matched a module, alpha is the effective number."""
        found: dict[str, LoraSettings] = {}
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer) or ADAPTER_NAME not in module.r:
                continue
            group = parameter_group(name)
            target = EXPERTS if isinstance(module, ParamWrapper) else name.rsplit(".", 1)[-1]
            dropout = module.lora_dropout[ADAPTER_NAME]
            settings = LoraSettings(rank=module.r[ADAPTER_NAME], alpha=module.lora_alpha[ADAPTER_NAME],
                                    dropout=dropout.p if isinstance(dropout, nn.Dropout) else 0.0, targets=(target,))
            known = found.setdefault(group, settings)
            if (known.rank, known.alpha, known.dropout) != (settings.rank, settings.alpha, settings.dropout):
                raise ValueError(f"the {group} LoRA layers differ in rank, alpha or dropout ({name}): no LoraPlan "
                                 f"describes them")
            known.targets = tuple(t for t in GROUP_TARGETS[group] if t in {*known.targets, target})
        return cls(**{group: found.get(group) for group in ("decoder", "gca", "encoder")}) if found else None


def lora_config(plan: LoraPlan) -> LoraConfig:
    """One PEFT LoraConfig whose regex targets and rank/alpha patterns give each group its own settings; the
    decoder's `experts` become target_parameters, ranked by the decoder's pattern too."""
    groups = {g: s for g, s in (("decoder", plan.decoder), ("gca", plan.gca), ("encoder", plan.encoder)) if s}
    if not groups:
        raise ValueError("LoraPlan names no group: set at least one of decoder, gca, encoder")
    modules, patterns = [], {}
    for group, settings in groups.items():
        if settings.rank <= 0:
            raise ValueError(f"LoRA rank for {group} must be positive, got {settings.rank}")
        allowed = GROUP_TARGETS[group]
        if set(settings.targets) - set(allowed) or not settings.targets:
            hint = f" (`{EXPERTS}` is a decoder target)" if EXPERTS in settings.targets and group != "decoder" else ""
            raise ValueError(f"LoRA targets for {group} must be a non-empty subset of {allowed}, got "
                             f"{settings.targets}{hint}")
        names = [t for t in settings.targets if t != EXPERTS]
        if names:
            modules.append(_GROUP_PATTERNS[group].format(targets="|".join(map(re.escape, names))))
        names += [p.removeprefix("mlp.") for p in EXPERT_PARAMETERS] if EXPERTS in settings.targets else []
        patterns[group] = _GROUP_PATTERNS[group].format(targets="|".join(map(re.escape, names)))
    experts = plan.decoder is not None and EXPERTS in plan.decoder.targets
    dropout = max(s.dropout for s in groups.values())
    if experts and dropout:
        # PEFT folds expert LoRA into the weight (W + BA), where no dropout on the input can act; and one config
        # carries one dropout for every group, so the other groups cannot have it either.
        raise ValueError(f"LoRA on the MoE experts allows no dropout, and PEFT applies one dropout to every LoRA "
                         f"group: set dropout=0 in all groups, got {dropout}")
    first = next(iter(groups.values()))
    return LoraConfig(
        r=first.rank,
        lora_alpha=_alpha(first),
        lora_dropout=dropout,
        target_modules="|".join(f"(?:{p})" for p in modules) if modules else [],
        target_parameters=list(EXPERT_PARAMETERS) if experts else None,
        rank_pattern={patterns[g]: s.rank for g, s in groups.items()},
        alpha_pattern={patterns[g]: _alpha(s) for g, s in groups.items()},
        bias="none",
    )


def _alpha(settings: LoraSettings) -> float:
    return settings.alpha if settings.alpha is not None else 2 * settings.rank


def apply_lora(model: nn.Module, plan: LoraPlan) -> LoraConfig:
    """Injects LoRA adapters into `model` in place (PEFT); `LoraPlan.of(model)` reads the plan back."""
    if any(isinstance(m, LoraLayer) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters; build a fresh model to apply another plan")
    config = lora_config(plan)
    if config.target_parameters and not any(n.endswith(EXPERT_PARAMETERS) for n, _ in model.named_parameters()):
        raise ValueError(f"LoRA target {EXPERTS!r} needs a Qwen3-MoE decoder, and this decoder is dense: target its "
                         f"MLP with {', '.join(MLP)}")
    with warnings.catch_warnings():
        # PEFT checks rank_pattern keys against targeted modules only; a decoder with only `experts` targets
        # parameters, so its pattern would be reported as unused although it sets their rank.
        warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match")
        # On the meta device (memory plans) the adapters are created there too, never allocated.
        low_cpu_mem_usage = any(p.is_meta for p in model.parameters())
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME, low_cpu_mem_usage=low_cpu_mem_usage)
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

    `lora` trains a group's LoRA adapters (for GCA also its gates, which must open, and its chunk routers); `full`
    trains its base weights (not its adapters); `frozen` trains nothing of it.
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
        trains = _trains(name, group, modes[group])
        param.requires_grad_(trains)
        counts[group] += param.numel() if trains else 0
    return counts


def trainable_modes(model: nn.Module) -> dict[str, TrainMode]:
    """Each group's mode as set_trainable left it, read off requires_grad (what the optimizer gets), so what is
    saved or counted is what really trains. Raises when a group's flags fit no mode (set by hand)."""
    names = [(n, p.requires_grad) for n, p in model.named_parameters()]
    modes = {}
    for group in ("decoder", "encoder", "gca"):
        own = [(n, trains) for n, trains in names if parameter_group(n) == group]
        has_lora = any("lora_" in n for n, _ in own)
        fitting = [mode for mode in TRAIN_MODES if (mode != "lora" or has_lora)
                   and all(trains == _trains(n, group, mode) for n, trains in own)]
        if not fitting:
            raise ValueError(f"requires_grad of the {group} parameters fits no train mode of {TRAIN_MODES}: "
                             f"set it with set_trainable")
        modes[group] = fitting[0]
    return modes


def _trains(name: str, group: str, mode: TrainMode) -> bool:
    """`full` trains the base weights, `lora` the adapters (and GCA's gates and chunk routers: new, small, and with no
    pretrained behaviour to keep), `frozen` nothing."""
    is_lora = "lora_" in name
    gate = group == "gca" and (name.endswith("gate") or ".router." in name)
    return (mode == "full" and not is_lora) or (mode == "lora" and (is_lora or gate))


@torch.no_grad()
def merged_state_dict(module: nn.Module, *, base_only: bool) -> dict[str, torch.Tensor]:
    """The state dict with LoRA merged into the base weights by PEFT and PEFT's `.base_layer.` steps removed.

    Each adapted layer is merged and unloaded as PEFT's merge_and_unload does it, in a copy of that layer alone,
    so the live model keeps its adapters and its exact base weights (an in-place merge and unmerge would round
    them in bf16), and only one layer at a time is copied (a copy of the whole model may not fit).
    base_only=True gives the base model as transformers names it (wrapped layers unwrapped, GCA left out), so a
    decoder or encoder saves as a plain checkpoint; base_only=False keeps only what AwarenessModel adds.
    """
    merged = {}
    for name, sub in module.named_modules():
        # the outermost wrapper of a layer: expert parameters nest one wrapper per targeted parameter
        if isinstance(sub, BaseTunerLayer) and not isinstance(module.get_submodule(name.rpartition(".")[0]),
                                                               BaseTunerLayer):
            merged |= {f"{name}.{key}": t for key, t in _merged_copy(sub).state_dict().items()}
    state = {}
    for name, tensor in module.state_dict().items():
        if "lora_" in name or is_added_parameter(name) == base_only:
            continue
        key = _without_base_layer(name)
        state[key.replace(".decoder_layer.", ".") if base_only else key] = merged.get(key, tensor)
    return state


def _merged_copy(layer: BaseTunerLayer) -> nn.Module:
    """PEFT's per-layer step of merge_and_unload (nested expert wrappers merge through their own method), on a
    copy of the layer: its base module with the adapter merged in."""
    layer = copy.deepcopy(layer)
    if hasattr(layer, "unload_and_optionally_merge_module"):
        return layer.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=[ADAPTER_NAME])
    layer.merge(adapter_names=[ADAPTER_NAME])
    return layer.get_base_layer()


def _without_base_layer(name: str) -> str:
    """PEFT's wrapper steps removed; expert parameters sit under one per targeted parameter (nested wrappers)."""
    return re.sub(r"(?:\.base_layer)+(?=\.|$)", "", name)
