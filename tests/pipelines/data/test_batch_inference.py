"""The batch-inference helper's setup, read off the calls it makes (no Ray started: the Ray jobs that use it, in
test_memory_store, test_teacher_logits, test_improve and the evaluation tests, run it for real)."""

from __future__ import annotations

import pytest
import ray
import torch

from pipelines.data.batch_inference import DTYPES, MAX_BLOCKS, actor_dtype, items_dataset, map_with_actors


def test_the_dtype_is_the_one_named_else_bfloat16_on_gpu_float32_on_cpu():
    assert actor_dtype("float16", use_gpu=False) == "float16"
    assert actor_dtype(None, use_gpu=True) == "bfloat16"
    assert actor_dtype(None, use_gpu=False) == "float32"
    assert DTYPES[actor_dtype(None, use_gpu=True)] is torch.bfloat16


@pytest.mark.parametrize("n, per_block, blocks", [(0, 1, 1), (3, 1, 3), (3, 4, 1), (40, 4, 10), (1000, 1, MAX_BLOCKS),
                                                  (1000, 8, MAX_BLOCKS), (5, None, 1)])
def test_items_are_cut_into_blocks_of_per_block_items_at_most_max_blocks(monkeypatch, n, per_block, blocks):
    calls = []
    monkeypatch.setattr(ray.data, "from_items", lambda items, override_num_blocks: calls.append(override_num_blocks))
    items_dataset([{"i": i} for i in range(n)], per_block=per_block)
    assert calls == [blocks]


class Recorder:
    def map_batches(self, fn, **kwargs):
        self.fn, self.kwargs = fn, kwargs
        return self


@pytest.mark.parametrize("use_gpu, gpus", [(False, 0), (True, 1)])
def test_every_actor_reserves_its_cpus_and_one_gpu_with_use_gpu(use_gpu, gpus):
    class Actor:
        pass

    dataset = map_with_actors(Recorder(), Actor, actors=3, batch_size=4, cpus_per_actor=1.5, use_gpu=use_gpu,
                              constructor_kwargs={"export": "E"}, batch_format="pyarrow")
    compute = dataset.kwargs.pop("compute")
    assert dataset.fn is Actor and isinstance(compute, ray.data.ActorPoolStrategy)
    assert (compute.min_size, compute.max_size) == (3, 3)
    assert dataset.kwargs == {"batch_size": 4, "batch_format": "pyarrow", "num_cpus": 1.5, "num_gpus": gpus,
                              "fn_constructor_kwargs": {"export": "E"}}
