"""Which decoder layers get a gated cross-attention (GCA) block."""

from __future__ import annotations

from collections.abc import Sequence

PLACEMENT_HELP = (
    '"upper_third", "upper_half", "every_k:N", "last:N", a comma-separated list such as "24,28,32", '
    "or a list of layer indices"
)


def resolve_gca_layers(spec: str | Sequence[int], num_layers: int) -> list[int]:
    """Turns a placement spec into sorted, unique layer indices of a decoder with `num_layers` layers.

    `upper_third` is the plan's default (Qwen3-8B: 24-35, Qwen3-30B-A3B: 32-47, Qwen3-0.6B: 19-27).
    `every_k:N` counts from the top, so the last layer always reads the memory: N-1, 2N-1, ... of a
    depth divisible by N.
    """
    if num_layers <= 0:
        raise ValueError(f"decoder depth must be positive, got {num_layers}")
    layers = _parse(spec, num_layers)
    if not layers:
        raise ValueError(f"GCA placement {spec!r} selects no layer of a {num_layers}-layer decoder; "
                         f"use {PLACEMENT_HELP}")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"GCA placement {spec!r} names layers {bad} outside the decoder's {num_layers} layers "
            f"(valid indices 0-{num_layers - 1})"
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"GCA placement {spec!r} repeats a layer: {sorted(layers)}")
    return sorted(layers)


def _parse(spec: str | Sequence[int], num_layers: int) -> list[int]:
    if not isinstance(spec, str):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise ValueError(f"GCA placement list must hold integers, got {list(spec)!r}")
        return list(spec)
    text = spec.strip()
    if text == "upper_third":
        return list(range(num_layers - num_layers // 3, num_layers))
    if text == "upper_half":
        return list(range(num_layers - num_layers // 2, num_layers))
    if text.startswith(("every_k:", "last:")):
        kind, _, count = text.partition(":")
        n = _positive_int(count, spec)
        if kind == "last":
            return list(range(num_layers - n, num_layers))
        return [i for i in range(num_layers) if (num_layers - 1 - i) % n == 0]
    if text and all(part.strip().lstrip("-").isdigit() for part in text.split(",")):
        return [int(part) for part in text.split(",")]
    raise ValueError(f"unknown GCA placement {spec!r}; use {PLACEMENT_HELP}")


def _positive_int(text: str, spec: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise ValueError(f"GCA placement {spec!r} needs a positive integer after the colon")
    return int(text)
