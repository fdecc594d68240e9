"""How the model's own code creates and writes parameters when an engine partitions them as they are created
(DeepSpeed ZeRO-3's zero.Init). A Protocol, so models/ never imports the engine; the default partitions nothing."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Iterable, Protocol

from torch import nn


class Partitioner(Protocol):
    def creating(self) -> AbstractContextManager:
        """Modules constructed inside get their parameters partitioned over the ranks as each module is built,
        so no rank holds more than one module in full."""

    def gathered(self, params: Iterable[nn.Parameter]) -> AbstractContextManager:
        """Inside, `params` are whole on every rank; on exit the first rank's values are kept (every rank runs the
        same writes, so random initialisation consumes the same random numbers everywhere)."""


class Unpartitioned:
    """Parameters live whole in every process: creating and gathering change nothing."""

    def creating(self) -> AbstractContextManager:
        return nullcontext()

    def gathered(self, params: Iterable[nn.Parameter]) -> AbstractContextManager:
        return nullcontext()


UNPARTITIONED = Unpartitioned()
