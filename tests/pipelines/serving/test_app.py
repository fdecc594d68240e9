"""The Ray Serve application over real HTTP on loopback: a tiny export registered in a real `mlflow server`, served
from `models:/NAME@candidate`; memories created, deduplicated, evicted and reloaded from disk; every 4xx; streaming;
answers equal to the pyfunc's."""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from ray.serve.schema import ServeDeploySchema

from pipelines.memory.store import write
from pipelines.serving.app import AwarenessServer
from pipelines.serving.loopback import free_port
from pipelines.serving.tiny import needle_questions, register_tiny_export

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[3]
NAME = "awareness-serve-test"


@pytest.fixture(scope="module")
def registered(tmp_path_factory, checkpoint_root, mlflow_server):
    register_tiny_export(tmp_path_factory.mktemp("serve-registry"), checkpoint_root, mlflow_server.uri, "serve-test",
                         NAME)
    return f"models:/{NAME}@candidate"


@pytest.fixture(scope="module")
def server(registered, mlflow_server, tmp_path_factory):
    import httpx
    import ray
    from ray import serve

    from pipelines.serving.app import build

    memory_dir = tmp_path_factory.mktemp("memories")
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": registered, "memory_dir": str(memory_dir), "tracking_uri": mlflow_server.uri,
            "max_memory_tokens": 400, "memory_budget_mb": 0.001}  # ~1 KB: one warm memory
    serve.run(build(args), name="awareness", route_prefix="/")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)

    def restart(**changes):  # new replicas (a restart): the cache starts empty, the disk store stays
        serve.run(build(args | changes), name="awareness", route_prefix="/")

    yield client, memory_dir, restart, port
    client.close()
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def pyfunc(registered, mlflow_server):
    import mlflow

    os.environ["MLFLOW_TRACKING_URI"] = mlflow_server.uri
    try:
        return mlflow.pyfunc.load_model(registered)
    finally:
        del os.environ["MLFLOW_TRACKING_URI"]


def test_memory_create_dedup_get_delete(server):
    client, memory_dir, _, _ = server
    rows, _ = needle_questions(seed=3, memories=1)
    created = client.post("/v1/memories", json={"chunks": rows[0]["memory"]})
    assert created.status_code == 201, created.text
    body = created.json()
    assert re.fullmatch(r"[0-9a-f]{64}", body["id"]) and body["chunks"] == len(rows[0]["memory"])
    assert body["tokens"] > 0 and body["encoder"]["hidden_size"] > 0 and body["source"] == "encoded"
    again = client.post("/v1/memories", json={"chunks": rows[0]["memory"]})
    assert again.status_code == 200 and again.json()["id"] == body["id"] and again.json()["source"] == "cache"
    assert client.get(f"/v1/memories/{body['id']}").json()["tokens"] == body["tokens"]
    assert (memory_dir / body["id"] / "store.json").is_file()
    assert client.delete(f"/v1/memories/{body['id']}").status_code == 200
    assert not (memory_dir / body["id"]).exists()
    missing = client.get(f"/v1/memories/{body['id']}")
    assert missing.status_code == 404 and "POST /v1/memories" in missing.json()["detail"]
    assert client.delete(f"/v1/memories/{body['id']}").status_code == 404


def test_answers_equal_the_pyfunc_batched_and_streamed(server, pyfunc):
    import concurrent.futures

    client, memory_dir, _, _ = server
    rows, _ = needle_questions(seed=5, memories=2)
    ids = {}
    for row in rows:
        key = tuple(row["memory"])
        if key not in ids:
            ids[key] = client.post("/v1/memories", json={"chunks": row["memory"]}).json()["id"]
    rows = rows[:8]
    expected = [pyfunc.predict(row)[0] for row in rows]
    stored = [pyfunc.predict({"question": r["question"], "memory_store": str(memory_dir / ids[tuple(r["memory"])])})[0]
              for r in rows]
    assert stored == expected  # the store's memory reads as the chunk texts do

    def ask(row):
        response = client.post("/v1/completions", json={"prompt": row["question"], "memory": ids[tuple(row["memory"])]})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # arrive together: batched across clients
        answers = list(pool.map(ask, rows))
    assert answers == expected
    row = rows[0]
    with client.stream("POST", "/v1/completions",
                       json={"prompt": row["question"], "memory": ids[tuple(row["memory"])], "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parts = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(p["text"] for p in parts) == expected[0] and parts[-1]["finish_reason"] in ("stop", "length")
    assert len([p for p in parts if p["text"]]) >= 2  # token by token, not one piece


def test_bad_input_gets_a_clear_4xx(server, checkpoint_root):
    client, memory_dir, _, _ = server
    unknown = client.post("/v1/completions", json={"prompt": "k1 =", "memory": "0" * 64})
    assert unknown.status_code == 404 and "POST /v1/memories" in unknown.json()["detail"]
    for bad in ["../../etc", "%2e%2e%2fetc", str(memory_dir)]:  # never a path
        assert client.post("/v1/completions", json={"prompt": "k1 =", "memory": bad}).status_code == 404
    big = client.post("/v1/memories", json={"chunks": ["k1 = 2 ;" * 200]})
    assert big.status_code == 413 and "400 tokens" in big.json()["detail"]
    assert client.post("/v1/memories", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    assert client.post("/v1/memories", json={"chunks": "one string"}).status_code == 422
    assert client.post("/v1/memories", json={"chunks": []}).status_code == 422
    assert client.post("/v1/completions", json={"memory": "0" * 64}).status_code == 422
    assert client.post("/v1/completions", json={"prompt": "k1 =", "max_tokens": -1}).status_code == 422
    # a store another encoder made, under an id on this server's disk
    from pipelines.memory.store import EncoderIdentity

    other = EncoderIdentity("elsewhere", "c" * 64, "w" * 64, None, "causal", 64, "float32")
    write(memory_dir / ("e" * 64), [("m", 0, "k1 = 2 ;")], [torch.zeros(3, 64)], other)
    conflict = client.post("/v1/completions", json={"prompt": "k1 =", "memory": "e" * 64})
    assert conflict.status_code == 409 and "another encoder" in conflict.json()["detail"]
    assert str(memory_dir) not in conflict.json()["detail"]


def test_lru_evicts_under_a_tiny_budget_and_a_restart_reloads_from_disk(server):
    client, _, restart, _ = server  # its budget (~1 KB) keeps one memory warm
    rows, _ = needle_questions(seed=9, memories=2)
    first, second = rows[0]["memory"], next(r["memory"] for r in rows if r["memory"] != rows[0]["memory"])
    a = client.post("/v1/memories", json={"chunks": first}).json()
    b = client.post("/v1/memories", json={"chunks": second}).json()
    assert a["source"] == b["source"] == "encoded"
    stats = client.get("/v1/stats").json()
    assert stats["memories"] == 1 and stats["evicted"] >= 1 and stats["bytes"] == b["bytes"]
    assert client.get(f"/v1/memories/{a['id']}").json()["source"] == "disk"  # evicted, reloaded, not re-encoded
    restart(memory_budget_mb=1024)
    assert client.get(f"/v1/memories/{b['id']}").json()["source"] == "disk"
    again = client.post("/v1/memories", json={"chunks": first}).json()
    assert again["id"] == a["id"] and again["source"] == "disk"
    assert client.get("/v1/stats").json()["encoded"] == 0


def test_documented_curl_commands_run(server):
    """docs/serving.md's curl commands, against this server (its port; MEMORY_ID from the create command)."""
    client, _, _, port = server
    text = (ROOT / "docs" / "serving.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"^(curl [^\n]+)$", text, flags=re.M)
    assert len(commands) >= 4, commands
    memory = None
    for command in commands:
        command = command.replace("localhost:8000", f"127.0.0.1:{port}")
        if memory:
            command = command.replace("$MEMORY", memory)
        elif "$MEMORY" in command:
            pytest.fail(f"{command} uses $MEMORY before a command creates it")
        out = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (command, out.stderr)
        if "/v1/memories -" in command or command.rstrip().endswith("/v1/memories"):
            memory = json.loads(out.stdout)["id"]
        if "/v1/completions" in command and "stream" not in command:
            assert "choices" in json.loads(out.stdout), out.stdout



def test_the_serve_config_in_the_repository_is_a_valid_serve_deploy_config_for_build():
    """pipelines/serving/awareness.yaml (what `serve run` / `serve deploy` read, docs/serving.md): Ray Serve's own
    schema accepts it, its import path is the application builder, and its args are the deployment's arguments."""
    config = yaml.safe_load((ROOT / "pipelines" / "serving" / "awareness.yaml").read_text())
    (application,) = ServeDeploySchema.model_validate(config).applications
    assert application.import_path == "pipelines.serving.app:build"
    inits = [vars(c)["__init__"] for c in AwarenessServer.func_or_class.__mro__ if "__init__" in vars(c)]
    accepted = next(p for p in (inspect.signature(i).parameters for i in inits) if "model" in p)  # under the ingress
    assert set(application.args) <= set(accepted) and "model" in application.args
    assert [d.name for d in application.deployments] == ["AwarenessServer"]
