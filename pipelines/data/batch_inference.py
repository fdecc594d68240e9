"""Ray Data batch inference, the one way a job runs a model over many work items: the items as a dataset, mapped by
a pool of actors that each load the model once (`map_batches` with a callable class).

Memory encoding, the teacher logits, stage 3's teacher and the evaluation suites all run so: each actor reserves
`cpus_per_actor` CPUs and, with `use_gpu`, one GPU, and loads its model in one of DTYPES.
"""

from __future__ import annotations

from typing import Any

import ray
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_BLOCKS = 64  # blocks a list of work items is cut into at most: the actors share out blocks, not rows


def actor_dtype(dtype: str | None, use_gpu: bool) -> str:
    """The dtype an actor loads its model in: the one named, else bfloat16 on a GPU and float32 on a CPU."""
    return dtype or ("bfloat16" if use_gpu else "float32")


def items_dataset(items: list[dict[str, Any]], *, per_block: int | None = 1) -> ray.data.Dataset:
    """The work items as a dataset of `per_block` items a block (at most MAX_BLOCKS blocks; None: one block)."""
    blocks = 1 if per_block is None else max(1, min(len(items) // per_block, MAX_BLOCKS))
    return ray.data.from_items(items, override_num_blocks=blocks)


def map_with_actors(dataset: ray.data.Dataset, actor: type, *, actors: int, batch_size: int, cpus_per_actor: float,
                    use_gpu: bool, constructor_kwargs: dict[str, Any],
                    batch_format: str = "default") -> ray.data.Dataset:
    """`dataset` mapped in batches of `batch_size` rows by a pool of `actors` instances of `actor`, each built once
    with `constructor_kwargs`."""
    return dataset.map_batches(actor, batch_size=batch_size, batch_format=batch_format,
                               compute=ray.data.ActorPoolStrategy(size=actors), num_cpus=cpus_per_actor,
                               num_gpus=1 if use_gpu else 0, fn_constructor_kwargs=constructor_kwargs)
