"""The worker loop's wiring that needs no training run: which tracking URI a worker logs to, and what a training step
asks of its recipe, in which order."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import ray.util
import torch
import torch.distributed as dist

from pipelines.train.configs.common import TrainConfig
from pipelines.train.loop import train_step, worker_tracking_uri
from pipelines.train.recipes import Loss, TrainState


def test_a_loopback_server_is_loopback_on_the_drivers_node_and_its_address_elsewhere(monkeypatch):
    config = {"tracking_uri": "http://127.0.0.1:5000", "driver_ip": "10.0.1.7"}
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.1.7")
    assert worker_tracking_uri(config) == "http://127.0.0.1:5000"  # a server bound to loopback alone still answers
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.1.8")
    assert worker_tracking_uri(config) == "http://10.0.1.7:5000"
    shared = "sqlite:////mnt/shared/mlflow.db"
    assert worker_tracking_uri({**config, "tracking_uri": shared}) == shared
    assert worker_tracking_uri({"tracking_uri": None, "driver_ip": "10.0.1.7"}) is None


class RecordingRecipe:
    """What train_step asks of a recipe, recorded in order."""

    def __init__(self):
        self.calls = []

    def at_step(self, engine, config, step):
        self.calls.append(("at_step", step))

    def loss(self, engine, config, batch):
        self.calls.append(("loss", batch["step"]))
        return Loss(engine.weight.sum() * batch["x"], {})

    def count_tokens(self, batch):
        return 1


class StepStream:
    def batch(self, step, micro):
        return {"x": torch.tensor(1.0), "step": step}, 1, step


def test_each_step_sets_what_the_recipe_changes_with_the_step_before_its_loss():
    """stage 0's base-step reading (needle.base_top_k) holds only if the loop sets it before every step's forward,
    from the step it trains: at_step(s) comes before step s's micro-batches, never after."""
    weight = torch.nn.Parameter(torch.ones(2))
    engine = SimpleNamespace(weight=weight, backward=lambda loss: loss.backward(), step=lambda: None,
                             get_lr=lambda: [1e-3])
    config = SimpleNamespace(train=TrainConfig(max_steps=3, grad_accum=2, memories_per_step=2))
    recipe, state = RecordingRecipe(), TrainState(step=5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        for _ in range(2):
            train_step(engine, recipe, config, state, StepStream())
    finally:
        dist.destroy_process_group()
    assert recipe.calls == [("at_step", 5), ("loss", 5), ("loss", 5), ("at_step", 6), ("loss", 6), ("loss", 6)]
    assert state.step == 7
