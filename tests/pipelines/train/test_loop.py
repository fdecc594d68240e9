"""The worker loop's wiring that needs no training run: which tracking URI a worker logs to."""

from __future__ import annotations

import ray.util

from pipelines.train.loop import worker_tracking_uri


def test_a_loopback_server_is_loopback_on_the_drivers_node_and_its_address_elsewhere(monkeypatch):
    config = {"tracking_uri": "http://127.0.0.1:5000", "driver_ip": "10.0.1.7"}
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.1.7")
    assert worker_tracking_uri(config) == "http://127.0.0.1:5000"  # a server bound to loopback alone still answers
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.1.8")
    assert worker_tracking_uri(config) == "http://10.0.1.7:5000"
    shared = "sqlite:////mnt/shared/mlflow.db"
    assert worker_tracking_uri({**config, "tracking_uri": shared}) == shared
    assert worker_tracking_uri({"tracking_uri": None, "driver_ip": "10.0.1.7"}) is None
