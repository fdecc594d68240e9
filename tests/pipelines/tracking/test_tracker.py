"""The Tracker against a real `mlflow server`: a server that goes away mid-run costs nothing but a queue, which is
logged when it returns or listed at the end; nothing secret reaches a run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipelines.tracking.tracker import REDACTED, Tracker, for_other_nodes, redact, redact_tree

FAKE_TOKEN = "hf_FAKEtoken0123456789abcdef"


def test_server_down_mid_run_queues_lists_at_the_end_and_logs_when_it_returns(mlflow_server, tmp_path):
    """The session's server is stopped under a live run and restarted (the other tests see it running)."""
    from mlflow.tracking import MlflowClient

    server = mlflow_server
    tracker = Tracker.start(server.uri, "tracking-test", "outage", {"train": {"lr": 0.1}})
    tracker.log_metrics({"loss": 3.0}, step=1)
    assert tracker.unlogged() == []

    server.stop()
    try:
        (tmp_path / "export").mkdir()
        (tmp_path / "export" / "weights.txt").write_text("small artifact")
        started = time.monotonic()
        tracker.log_metrics({"loss": 2.0}, step=2)  # must not raise, nor stall the training step for minutes
        assert time.monotonic() - started < 60
        started = time.monotonic()
        tracker.log_artifacts(tmp_path / "export", "export")
        tracker.log_metrics({"loss": 1.0}, step=3)
        assert time.monotonic() - started < 1  # within the retry window calls only queue: no network wait at all
        assert tracker.failures >= 1
        assert tracker.close() == ["log_metrics", "log_artifacts", "log_metrics", "terminate"]  # listed at the end
        tracker.save_pending(tmp_path / "pending.json")  # as a worker hands its queue to the driver
    finally:
        server.start()

    driver = Tracker(server.uri, tracker.run_id)
    driver.adopt_pending(tmp_path / "pending.json")
    assert driver.flush() == [] and not (tmp_path / "pending.json").exists()
    client = MlflowClient(server.uri)
    history = client.get_metric_history(tracker.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert [a.path for a in client.list_artifacts(tracker.run_id, "export")] == ["export/weights.txt"]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_a_failed_call_is_retried_in_order_by_the_next_one(mlflow_server):
    """Writes refused for a while: the queue drains in order once they are accepted again."""
    from mlflow.tracking import MlflowClient

    uri = mlflow_server.uri
    tracker = Tracker.start(uri, "tracking-test", "order", {})
    tracker.retry_interval_s = 0.0  # retry at every call
    run_id = tracker.run_id
    tracker.run_id = "no-such-run"  # every write fails, as with a server that is down
    tracker.log_metrics({"loss": 2.0}, step=1)
    tracker.log_metrics({"loss": 1.0}, step=2)
    assert tracker.unlogged() == ["log_metrics", "log_metrics"]
    tracker.run_id = run_id
    tracker.log_metrics({"loss": 0.5}, step=3)
    assert tracker.unlogged() == []
    assert [m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")] == [1, 2, 3]


def test_secrets_are_redacted_from_params_and_config():
    flat = {"tracking.tracking_uri": f"https://alice:{FAKE_TOKEN}@mlflow.example.com:5000", "hub.api_key": FAKE_TOKEN,
            "data.auth_token": FAKE_TOKEN, "train.lr": 0.1, "tracking.experiment": "awareness"}
    logged = redact(flat)
    assert FAKE_TOKEN not in str(logged)
    assert logged["tracking.tracking_uri"] == f"https://{REDACTED}@mlflow.example.com:5000"
    assert logged["train.lr"] == 0.1 and logged["tracking.experiment"] == "awareness"
    nested = redact_tree({"tracking": {"tracking_uri": flat["tracking.tracking_uri"]}, "hub": {"token": FAKE_TOKEN}})
    assert FAKE_TOKEN not in str(nested) and nested["hub"]["token"] == REDACTED


@pytest.mark.slow
@pytest.mark.ray
def test_a_stage_run_outlives_its_tracking_server(mlflow_server, tmp_path, checkpoint_root):
    """The server dies after the first logged steps: the run trains to the end, keeps its checkpoints, and its
    summary lists what could not be logged."""
    import threading

    import ray
    from mlflow.tracking import MlflowClient

    from pipelines.train.configs.common import RunSettings, TrackingSettings, TrainConfig
    from pipelines.train.configs.stage import ModelConfig, NeedleConfig, StageConfig
    from pipelines.train.recipes.jobs import train

    config = StageConfig(
        model=ModelConfig(pair="tiny", checkpoint_root=str(checkpoint_root), decoder="lora", gca_layers="upper_half"),
        needle=NeedleConfig(facts=4, questions=4, val_memories=8),
        train=TrainConfig(max_steps=40, memories_per_step=8, log_every=1, eval_every=20, checkpoint_every=20),
        run=RunSettings(name="stage-outage", storage_path=str(tmp_path / "ray"), max_failures=0),
        tracking=TrackingSettings(tracking_uri=mlflow_server.uri, experiment="tracking-test"),
    )
    client, stopped = MlflowClient(mlflow_server.uri), threading.Event()

    def stop_after_first_steps() -> None:
        while not stopped.is_set():
            runs = client.search_runs([client.get_experiment_by_name("tracking-test").experiment_id],
                                      filter_string="attributes.run_name = 'stage-outage'")
            if runs and len(client.get_metric_history(runs[0].info.run_id, "loss")) >= 2:
                mlflow_server.stop()
                stopped.set()
            time.sleep(0.5)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    watcher = threading.Thread(target=stop_after_first_steps, daemon=True)
    try:
        client.get_experiment_by_name("tracking-test") or client.create_experiment("tracking-test")
        watcher.start()
        summary = train(config)
    finally:
        stopped.set()
        ray.shutdown()
        mlflow_server.start()
    assert summary["error"] is None and summary["steps"] == 40
    assert (tmp_path / "ray" / "stage-outage").is_dir() and (Path(summary["checkpoint"]) / "export").is_dir()
    assert "log_metrics" in summary["tracking_unlogged"] and "terminate" in summary["tracking_unlogged"]


def test_a_workers_unlogged_queue_reaches_the_driver_as_data(tmp_path):
    """The queue crosses processes as JSON (bytes included), and only tracker calls are replayed from it."""
    from pipelines.tracking.tracker import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    worker = Tracker(uri, "run-a")
    worker.pending = [("log_metrics", ({"loss": 1.5}, 3), {}), ("log_bytes", (b"\x89PNG\x00", "gates.png"), {})]
    path = tmp_path / "pending.json"
    worker.save_pending(path)
    text = path.read_text()
    assert "loss" in text and "PNG" not in text  # bytes travel base64-encoded
    saved = __import__("json").loads(text)
    path.write_text(__import__("json").dumps(saved + [["__class__", [], {}]]))  # a planted entry
    driver = Tracker(uri, "run-a")
    driver.adopt_pending(path)
    assert driver.pending == [("log_metrics", ({"loss": 1.5}, 3), {}), ("log_bytes", (b"\x89PNG\x00", "gates.png"), {})]
    assert not path.exists()


def test_a_loopback_server_reaches_other_nodes_as_the_drivers_address():
    """On a cluster the driver runs on the head beside the MLflow server (http://127.0.0.1:5000); workers on the GPU
    nodes must use the head's address for the same server. Remote servers and file stores are left alone."""
    assert for_other_nodes("http://127.0.0.1:5000", "10.0.1.7") == "http://10.0.1.7:5000"
    assert for_other_nodes("https://u:p@localhost:5000/prefix", "10.0.1.7") == "https://u:p@10.0.1.7:5000/prefix"
    assert for_other_nodes("http://[::1]:5000", "fd00::7") == "http://[fd00::7]:5000"
    for unchanged in ("http://10.0.0.2:5000", "https://mlflow.example.com", "sqlite:////tmp/mlflow.db"):
        assert for_other_nodes(unchanged, "10.0.1.7") == unchanged
