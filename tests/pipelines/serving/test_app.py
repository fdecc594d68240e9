"""The Ray Serve application over real HTTP on loopback: a tiny export registered in a real `mlflow server`, served
from `models:/NAME@candidate`; memories created, deduplicated, evicted and reloaded from disk; every 4xx; streaming;
answers equal to the pyfunc's; a replica killed mid-request (the requests end at once, the next replica reads the
memory from disk)."""

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
    write(memory_dir / ("e" * 64), [("m", 0, "k1 = 2 ;")], [torch.zeros(3, 64)], [[5, 6, 7]], other)
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


def _replicas() -> list[str]:
    """The names of the application's live replica actors (Serve names them SERVE_REPLICA::app#deployment#id)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::awareness#AwarenessServer#"))


def test_a_replica_killed_mid_request_ends_the_request_at_once_and_its_successor_reads_memories_from_disk(server):
    """Measures what clients see when the only replica dies under their requests, and what the next replica knows.

    A memory is created and a greedy question over it answered. Then a streamed completion (max_tokens 4096,
    sampled, so it decodes for seconds) starts from a thread, and a plain one queues behind it in the replica (one
    generate at a time); once the stream's first tokens have arrived, the replica actor is killed with
    `ray.kill(actor, no_restart=False)` (Serve creates replicas with max_restarts=0: its controller, not Ray, replaces
    it). Measured: each in-flight client ends within 60 s of the kill (it ends in well under a second: the streamed
    one with a broken chunked body after its 200 and no `[DONE]`, the plain one with Ray Serve's 500), a request sent
    just after the kill ends within its 90 s timeout (it waits for the new replica and is answered), and Serve has a
    healthy new replica within 120 s (serve.status() HEALTHY under a new actor name; 22-25 s here: the controller's next
    health check, then the model load). Then the same question over the same memory id, which is not created again,
    gets the same answer, and the new replica's GET /v1/stats counters say it read that memory from MEMORY_DIR
    (loaded 1, encoded 0) into an empty cache, not re-encoded it."""
    import threading
    import time

    import httpx
    import ray
    from ray import serve

    client, _, _, port = server
    rows, _ = needle_questions(seed=11, memories=1)
    created = client.post("/v1/memories", json={"chunks": rows[0]["memory"]})
    assert created.status_code in (200, 201), created.text
    memory = created.json()["id"]
    question = {"prompt": rows[0]["question"], "memory": memory}
    before = client.post("/v1/completions", json=question)
    assert before.status_code == 200, before.text
    answer = before.json()["choices"][0]["text"]
    (victim,) = _replicas()

    slow = {"prompt": "k1 =", "max_tokens": 4096, "temperature": 1.0}  # sampled: it rarely ends early, but can
    requests = {"stream": slow | {"stream": True}, "plain": slow, "gap": {"prompt": "k1 =", "max_tokens": 4}}

    def ask(kind: str):  # its own client and timeout: a hang fails the join below, it does not stall the suite
        outcome, events = outcomes[kind], []
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=90 if kind == "gap" else 60) as own:
                if kind != "stream":
                    r = own.post("/v1/completions", json=requests[kind])
                    outcome["status"], outcome["body"] = r.status_code, r.text
                    return
                with own.stream("POST", "/v1/completions", json=requests[kind]) as r:
                    outcome["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: "):])
                            streaming.set()
        except httpx.HTTPError as e:  # a broken stream, a refused or timed-out connection
            outcome["error"] = f"{type(e).__name__}: {e}"
        finally:
            outcome["events"], outcome["ended"] = events, time.monotonic()  # "ended" is set last
            streaming.set()

    for _attempt in range(5):  # a sampled end-of-answer can end the stream before the kill: then start again
        outcomes = {kind: {} for kind in requests}
        streaming = threading.Event()
        threads = {kind: threading.Thread(target=ask, args=(kind,), daemon=True) for kind in requests}
        threads["stream"].start()
        assert streaming.wait(60), "the streamed request never started"
        threads["plain"].start()  # queued in the replica behind the streamed decode
        time.sleep(1.0)
        if not any("ended" in outcomes[kind] for kind in ("stream", "plain")):
            break
        for kind in ("stream", "plain"):
            threads[kind].join(60)
    assert not any("ended" in outcomes[kind] for kind in ("stream", "plain")), f"ended before the kill: {outcomes}"
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)
    killed = time.monotonic()
    threads["gap"].start()
    for kind in ("stream", "plain"):
        threads[kind].join(max(0.0, killed + 60 - time.monotonic()))
        assert not threads[kind].is_alive(), f"the {kind} request hung for 60 s after its replica was killed"

    deadline, status = killed + 120, None
    while time.monotonic() < deadline:
        status = serve.status().applications["awareness"].deployments["AwarenessServer"]
        replicas = _replicas()  # the victim's name leaves at once; the new one appears when the controller notices
        running = (status.status, status.replica_states) == ("HEALTHY", {"RUNNING": 1})
        if running and replicas and victim not in replicas:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no healthy replica 120 s after the kill: {status}, replicas {_replicas()}")
    healthy = time.monotonic() - killed
    threads["gap"].join(max(0.0, killed + 100 - time.monotonic()))
    assert not threads["gap"].is_alive(), "a request sent just after the kill hung"
    for kind, outcome in outcomes.items():
        print(f"{kind}: {outcome.get('status')} {outcome.get('error') or outcome.get('body', '')[:200]!r} "
              f"({len(outcome['events'])} events), ended {outcome['ended'] - killed:+.1f} s after the kill")
    print(f"a new healthy replica {healthy:.1f} s after the kill")

    stream = outcomes["stream"]  # its 200 went out before the kill: the body breaks off, no [DONE]
    assert stream["status"] == 200 and "[DONE]" not in stream["events"] and "RemoteProtocolError" in stream["error"]
    for kind in ("plain", "gap"):  # an error status from Serve's proxy, or an answer (the new replica's)
        outcome = outcomes[kind]
        assert outcome.get("status") in (200, 500, 503), outcome
        if outcome["status"] == 200:
            assert json.loads(outcome["body"])["choices"][0]["finish_reason"] in ("stop", "length")

    stats = client.get("/v1/stats").json()
    assert stats["encoded"] == stats["loaded"] == stats["memories"] == 0, stats  # a new replica: an empty cache
    after = client.post("/v1/completions", json=question)  # the same id, not created again
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == answer
    stats = client.get("/v1/stats").json()
    assert stats["loaded"] == 1 and stats["encoded"] == 0, stats  # read back from MEMORY_DIR, not re-encoded
    assert client.get(f"/v1/memories/{memory}").json()["source"] == "cache"


SHAPES_PY = """\"\"\"Shapes.\"\"\"


class Square:
    def __init__(self, side):
        self.side = side

    def area(self):
        return self.side * self.side


class Circle:
    def __init__(self, radius):
        self.radius = radius

    def area(self):
        return 3.14159 * self.radius ** 2


def largest(shapes):
    return max(shapes, key=lambda shape: shape.area())
"""


def test_a_repository_sent_as_files_is_chunked_as_the_corpora_chunk_it(server, tmp_path):
    """POST /v1/memories {"files": [...]}: the corpora's chunker (tree-sitter cuts, a path header a chunk) over the
    model's own tokenizer gives the chunks, so the memory is the one those chunk texts make; a path is only a label.
    A needle-vocabulary model refuses files (no tokens for them) in a 422 naming the fix."""
    from models import PAIRS, build_pair, write_random_checkpoints
    from pipelines.corpora.tasks import readable_text, text_chunks
    from pipelines.format.tokenizer import QwenTokenizer
    from pipelines.serving.pyfunc import ensure_tokenizer

    client, _, restart, _ = server
    files = [{"path": "shapes/geometry.py", "text": SHAPES_PY}, {"path": "/etc/passwd", "text": "not this file"}]
    refused = client.post("/v1/memories", json={"files": files})
    assert refused.status_code == 422 and 'send "chunks"' in refused.json()["detail"]
    both = client.post("/v1/memories", json={"files": files, "chunks": ["x"]})
    assert both.status_code == 422 and "one of the two" in both.text

    decoder, encoder = write_random_checkpoints(PAIRS["tiny-text"], tmp_path / "checkpoints")
    export = tmp_path / "tiny-text-export"
    build_pair("tiny-text", checkpoint_root=tmp_path / "checkpoints", gca_layers="upper_half").save_pretrained(export)
    restart(model=str(export))
    try:
        created = client.post("/v1/memories", json={"files": files, "chunk_tokens": 48})
        assert created.status_code == 201, created.text
        ensure_tokenizer(decoder)
        tokenizer = QwenTokenizer(decoder)
        expected = [c.text for f in files for c in text_chunks(f["path"], readable_text(f["path"], f["text"]),
                                                               tokenizer, 48)]
        assert created.json()["chunks"] == len(expected) >= 3  # the classes and the function apart
        assert expected[-1] == "### /etc/passwd [chunk 0]\nnot this file"  # a label: nothing was opened
        same = client.post("/v1/memories", json={"chunks": expected})
        assert same.status_code == 200 and same.json()["id"] == created.json()["id"]
        asked = client.post("/v1/completions", json={"prompt": "def area", "memory": created.json()["id"],
                                                     "max_tokens": 3})
        assert asked.status_code == 200, asked.text
        too_long = client.post("/v1/memories", json={"files": files, "chunk_tokens": 4096})
        assert too_long.status_code == 422 and "1024 tokens" in too_long.json()["detail"]
    finally:
        restart()


@pytest.mark.parametrize("reads", ["rag", pytest.param("in_context", marks=pytest.mark.slow)])  # each: a restart
def test_a_baseline_is_served_with_its_memory_in_the_prompt(server, tmp_path, checkpoint_root, reads):
    """A baseline export behind the same routes: its memory is the chunk texts (no encoder runs, no encoder identity),
    deduplicated by content, and every answer, plain or streamed, is the pyfunc's `predict` over the same chunks
    (the memory put in the prompt as training put it: all of it for in_context, BM25's top-k for rag)."""
    from pipelines.serving.app import load_pyfunc
    from tests.pipelines.evaluate.test_job import export_of

    client, memory_dir, restart, _ = server
    export = export_of(tmp_path, checkpoint_root, reads)
    restart(model=str(export))
    try:
        rows, _ = needle_questions(seed=4, memories=1)
        reference = load_pyfunc(str(export))
        created = client.post("/v1/memories", json={"chunks": rows[0]["memory"]})
        assert created.status_code == 201, created.text
        memory = created.json()
        assert memory["encoder"] is None and memory["chunks"] == len(rows[0]["memory"])
        assert memory["tokens"] == sum(len(ids) for ids in reference.chunk_token_ids(rows[0]["memory"]))
        assert (memory_dir / memory["id"] / "chunks.json").is_file()
        again = client.post("/v1/memories", json={"chunks": rows[0]["memory"]})
        assert again.status_code == 200 and again.json()["id"] == memory["id"]
        expected = reference.predict(None, rows[:3], {"max_new_tokens": 4})
        for row, want in zip(rows[:3], expected):
            asked = client.post("/v1/completions", json={"prompt": row["question"], "memory": memory["id"],
                                                         "max_tokens": 4})
            assert asked.status_code == 200 and asked.json()["choices"][0]["text"] == want, asked.text
            prompt = len(reference.tokenizer.encode(row["question"]).ids)
            assert asked.json()["usage"]["prompt_tokens"] > prompt  # the memory is in the prompt
        with client.stream("POST", "/v1/completions", json={"prompt": rows[0]["question"], "memory": memory["id"],
                                                            "max_tokens": 4, "stream": True}) as streamed:
            events = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected[0]
        assert client.delete(f"/v1/memories/{memory['id']}").status_code == 200
        assert client.get(f"/v1/memories/{memory['id']}").status_code == 404
    finally:
        restart()


@pytest.mark.parametrize("name", ["awareness.yaml", "awareness-gpu.yaml"])
def test_the_serve_configs_in_the_repository_are_valid_serve_deploy_configs_for_build(name):
    """pipelines/serving/awareness.yaml and awareness-gpu.yaml (what `serve run` / `serve deploy` read,
    docs/serving.md): Ray Serve's own schema accepts each, its import path is the application builder, its args are
    the deployment's arguments, and the GPU one gives each replica a GPU and places the model there in bf16."""
    from pipelines.serving.pyfunc import placement

    config = yaml.safe_load((ROOT / "pipelines" / "serving" / name).read_text())
    (application,) = ServeDeploySchema.model_validate(config).applications
    assert application.import_path == "pipelines.serving.app:build"
    inits = [vars(c)["__init__"] for c in AwarenessServer.func_or_class.__mro__ if "__init__" in vars(c)]
    accepted = next(p for p in (inspect.signature(i).parameters for i in inits) if "model" in p)  # under the ingress
    assert set(application.args) <= set(accepted) and "model" in application.args
    (deployment,) = application.deployments
    assert deployment.name == "AwarenessServer"
    assert placement("cpu", application.args.get("dtype", "auto"))  # a dtype the loader takes
    if name == "awareness-gpu.yaml":
        assert deployment.ray_actor_options.num_gpus == 1
        assert (application.args["device"], application.args["dtype"]) == ("cuda", "bfloat16")


def test_a_replica_on_a_gpu_node_reaches_the_heads_mlflow_server(monkeypatch):
    """`serve deploy` on cluster.yaml's head with MLFLOW_TRACKING_URI=http://127.0.0.1:5000: a replica on a GPU node
    asks the head's address (where the server runs); on the head, or for any other URI, the URI is unchanged."""
    import ray

    from pipelines.serving.app import replica_tracking_uri

    nodes = [{"Alive": True, "NodeManagerAddress": "10.0.0.5", "Resources": {"CPU": 0.0, "node:__internal_head__": 1}},
             {"Alive": True, "NodeManagerAddress": "10.0.0.7", "Resources": {"GPU": 8.0}}]
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    assert replica_tracking_uri("http://127.0.0.1:5000") == "http://10.0.0.5:5000"
    assert replica_tracking_uri("http://mlflow.internal:5000") == "http://mlflow.internal:5000"
    assert replica_tracking_uri(None) is None
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.5")
    assert replica_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
