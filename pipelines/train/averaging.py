"""train.ema_decay: an exponential moving average of the trained weights, the weights evaluations and exports read.
A run's last steps still move its weights at the learning rate's floor; the average over the last ~1/(1 - decay)
steps is the usual remedy, though not one that helped the beyond-lexical preset (docs/jobs.md, "Weight averaging").
torch's EMA update (`torch.optim.swa_utils.get_ema_multi_avg_fn`) over the trained parameters alone, in fp32 beside
them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.optim.swa_utils import get_ema_multi_avg_fn

AVERAGE_FILE = "weight_average.safetensors"  # in every checkpoint of a run that averages, so a resume carries it on


class WeightAverage:
    """The average of `params` (whole on every rank: ZeRO 0-2) since the first `update`."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.updates = params, 0
        self.average = [p.detach().float().clone() for p in params]
        self._update = get_ema_multi_avg_fn(decay)

    @classmethod
    def of_trained(cls, model: torch.nn.Module, decay: float) -> WeightAverage | None:
        """The average of the model's trained parameters, or None where decay is 0 (no averaging)."""
        return cls([p for p in model.parameters() if p.requires_grad], decay) if decay > 0 else None

    def update(self) -> None:
        """After an optimizer step: the first sets the average to the weights, each later one moves it toward them."""
        current = [p.detach().float() for p in self.params]
        if self.updates == 0:
            for a, c in zip(self.average, current, strict=True):
                a.copy_(c)
        else:
            self._update(self.average, current, self.updates)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model for the block, the trained ones back after it (exactly)."""
        trained = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, a in zip(self.params, self.average, strict=True):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, t in zip(self.params, trained, strict=True):
                    p.copy_(t)

    def save(self, directory: Path) -> None:
        tensors = {f"{i}": a for i, a in enumerate(self.average)}
        save_file(tensors, str(Path(directory) / AVERAGE_FILE), metadata={"updates": str(self.updates)})

    def load(self, directory: Path) -> None:
        """From a checkpoint `save` wrote; a checkpoint of a run that did not average has none, and the average
        starts again from the resumed weights."""
        path = Path(directory) / AVERAGE_FILE
        if not path.is_file():
            return
        with safe_open(str(path), framework="pt") as f:
            tensors, updates = {k: f.get_tensor(k) for k in f.keys()}, int((f.metadata() or {}).get("updates", 1))
        if len(tensors) != len(self.average):
            raise ValueError(f"the checkpoint's weight average holds {len(tensors)} tensors and this model trains "
                             f"{len(self.average)}: resume with the run's own model settings")
        for i, a in enumerate(self.average):
            a.copy_(tensors[f"{i}"])
        self.updates = updates


def applied(average: WeightAverage | None):
    """`average.applied()`, or nothing where the run does not average."""
    return average.applied() if average is not None else contextlib.nullcontext()
