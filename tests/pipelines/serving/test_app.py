"""The Ray Serve application over real HTTP on loopback: a tiny export registered in a real `mlflow server`, served
from `models:/NAME@candidate` behind API keys (read from an environment variable the config names); memories created,
deduplicated, evicted and reloaded from disk, each its owner's alone; every 4xx; streaming; answers equal to the
pyfunc's; no server path in any response; a replica killed mid-request (the requests end at once, the next replica
reads the memory from disk)."""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from ray.serve.schema import ServeDeploySchema

from pipelines.memory.store import write
from pipelines.serving.app import ApiKey, AwarenessServer, check_open_host, load_keys
from pipelines.serving.memories import owner_directory
from pipelines.serving.tiny import needle_questions
from tests.pipelines.serving.conftest import ADMIN, ALICE, BOB, DISK_MB_PER_OWNER, KEYS, NAME, ROOT, message, stored

pytestmark = pytest.mark.ray
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
    assert (stored(memory_dir, body["id"]) / "store.json").is_file()
    assert client.delete(f"/v1/memories/{body['id']}").status_code == 200
    assert not stored(memory_dir, body["id"]).exists()
    missing = client.get(f"/v1/memories/{body['id']}")
    assert missing.status_code == 404 and "POST /v1/memories" in message(missing)
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
    from_store = [pyfunc.predict({"question": r["question"],
                                  "memory_store": str(stored(memory_dir, ids[tuple(r["memory"])]))})[0] for r in rows]
    assert from_store == expected  # the store's memory reads as the chunk texts do

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
    assert unknown.status_code == 404 and "POST /v1/memories" in message(unknown)
    for bad in ["../../etc", "%2e%2e%2fetc", str(memory_dir)]:  # never a path
        assert client.post("/v1/completions", json={"prompt": "k1 =", "memory": bad}).status_code == 404
    big = client.post("/v1/memories", json={"chunks": ["k1 = 2 ;" * 200]})
    assert big.status_code == 413 and "400 tokens" in message(big)
    assert client.post("/v1/memories", content=b"{not json",
                       headers={"content-type": "application/json"}).status_code == 422
    assert client.post("/v1/memories", json={"chunks": "one string"}).status_code == 422
    assert client.post("/v1/memories", json={"chunks": []}).status_code == 422
    assert client.post("/v1/completions", json={"memory": "0" * 64}).status_code == 422
    assert client.post("/v1/completions", json={"prompt": "k1 =", "max_tokens": -1}).status_code == 422
    # a store another encoder made, under an id on this server's disk
    from pipelines.memory.store import EncoderIdentity

    other = EncoderIdentity("elsewhere", "c" * 64, "w" * 64, None, "causal", 64, "float32")
    write(stored(memory_dir, "e" * 64), [("m", 0, "k1 = 2 ;")], [torch.zeros(3, 64)], [[5, 6, 7]], other)
    conflict = client.post("/v1/completions", json={"prompt": "k1 =", "memory": "e" * 64})
    assert conflict.status_code == 409 and "another encoder" in message(conflict)
    assert str(memory_dir) not in conflict.text and "elsewhere" not in conflict.text


def test_lru_evicts_under_a_tiny_budget_and_a_restart_reloads_from_disk(server):
    client, _, restart, _ = server  # its budget (~1 KB) keeps one memory warm
    rows, _ = needle_questions(seed=9, memories=2)
    first, second = rows[0]["memory"], next(r["memory"] for r in rows if r["memory"] != rows[0]["memory"])
    a = client.post("/v1/memories", json={"chunks": first}).json()
    b = client.post("/v1/memories", json={"chunks": second}).json()
    assert a["source"] == b["source"] == "encoded"
    stats = client.get("/v1/stats", headers=ADMIN).json()
    assert stats["memories"] == 1 and stats["evicted"] >= 1 and stats["bytes"] == b["bytes"]
    assert client.get(f"/v1/memories/{a['id']}").json()["source"] == "disk"  # evicted, reloaded, not re-encoded
    restart(memory_budget_mb=1024)
    assert client.get(f"/v1/memories/{b['id']}").json()["source"] == "disk"
    again = client.post("/v1/memories", json={"chunks": first}).json()
    assert again["id"] == a["id"] and again["source"] == "disk"
    assert client.get("/v1/stats", headers=ADMIN).json()["encoded"] == 0


def test_documented_curl_commands_run(server):
    """docs/serving.md's curl commands, against this server (its port; MEMORY from the create command, AWARENESS_KEY
    a key)."""
    client, _, _, port = server
    text = (ROOT / "docs" / "serving.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"^(curl [^\n]+)$", text, flags=re.M)
    assert len(commands) >= 4, commands
    memory = None
    for command in commands:
        command = command.replace("localhost:8000", f"127.0.0.1:{port}").replace("$AWARENESS_KEY", KEYS["alice"])
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


@pytest.mark.e2e
def test_a_replica_killed_mid_request_ends_the_request_at_once_and_its_successor_reads_memories_from_disk(server):
    """Measures what clients see when the only replica dies under their requests, and what the next replica knows.

    A memory is created and a greedy question over it answered. Then a streamed completion (max_tokens 4096,
    sampled with a seed, so it decodes for seconds) starts from a thread, and a plain one joins it in the replica's
    decoding loop; once the stream's first tokens have arrived, the replica actor is killed with
    `ray.kill(actor, no_restart=False)` (Serve creates replicas with max_restarts=0: its controller, not Ray, replaces
    it). Measured: each in-flight client ends within 60 s of the kill (it ends in well under a second: the streamed
    one with a broken chunked body after its 200 and no `[DONE]`, the plain one with Ray Serve's 500), a request sent
    just after the kill ends within its 90 s timeout (it waits for the new replica and is answered), and Serve has a
    healthy new replica within 120 s (serve.status() HEALTHY under a new actor name; 22-25 s here: the controller's next
    health check, then the model load). Then the same question over the same memory id, which is not created again,
    gets the same answer, and the new replica's GET /v1/stats counters say it read that memory from MEMORY_DIR
    (loaded 1, encoded 0) into an empty cache, not re-encoded it."""
    import threading

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

    # sampled with a seed (a seeded answer does not depend on its batch): seed 21 runs 2,758 tokens before the tiny
    # export's end token, the longest of seeds 0-59 (seed 0: 126); unseeded, a draw ends after ~300 and can end
    # before the kill
    slow = {"prompt": "k1 =", "max_tokens": 4096, "temperature": 1.0, "seed": 21}
    requests = {"stream": slow | {"stream": True}, "plain": slow, "gap": {"prompt": "k1 =", "max_tokens": 4}}

    def ask(kind: str):  # its own client and timeout: a hang fails the join below, it does not stall the suite
        outcome, events = outcomes[kind], []
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=90 if kind == "gap" else 60,
                              headers=ALICE) as own:
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

    stats = client.get("/v1/stats", headers=ADMIN).json()
    assert stats["encoded"] == stats["loaded"] == stats["memories"] == 0, stats  # a new replica: an empty cache
    after = client.post("/v1/completions", json=question)  # the same id, not created again
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == answer
    stats = client.get("/v1/stats", headers=ADMIN).json()
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


@pytest.mark.e2e
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
    assert refused.status_code == 422 and 'send "chunks"' in message(refused)
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
        assert too_long.status_code == 422 and "1024 tokens" in message(too_long)
    finally:
        restart()


@pytest.mark.parametrize("reads", [pytest.param("rag", marks=pytest.mark.e2e),
                                   pytest.param("in_context", marks=pytest.mark.slow)])  # each: a restart
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
        assert (stored(memory_dir, memory["id"]) / "chunks.json").is_file()
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


# ------------------------------------------------------------------------------------------- keys and owners
def test_every_route_answers_only_to_a_valid_key_and_stats_only_to_an_admin_key(server):
    import httpx

    client, _, _, port = server
    routes = [("POST", "/v1/memories", {"chunks": ["k1 = 2 ;"]}), ("GET", "/v1/memories/" + "0" * 64, None),
              ("DELETE", "/v1/memories/" + "0" * 64, None), ("POST", "/v1/completions", {"prompt": "k1 ="}),
              ("GET", "/v1/models", None), ("GET", "/v1/stats", None), ("GET", "/openapi.json", None)]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as anonymous:
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer " + KEYS["alice"][:-1] + "X"}, {"Authorization": "alice"},
                            {"Authorization": KEYS["alice"]}):
                refused = anonymous.request(method, path, json=body, headers=headers)
                assert refused.status_code == 401, (method, path, headers, refused.text)
                assert refused.headers["www-authenticate"] == "Bearer" and "API key" in message(refused)
        # the key is checked before the body: a bad body without a key is 401, not a 422 that describes the schema
        assert anonymous.post("/v1/completions", json={"max_tokens": "x"}).status_code == 401
        assert anonymous.get("/docs").status_code == 404  # off: the schema is /openapi.json, behind a key
    assert client.get("/openapi.json").json()["paths"]["/v1/completions"]
    assert client.get("/v1/models").status_code == 200
    forbidden = client.get("/v1/stats")
    assert forbidden.status_code == 403 and "admin key" in message(forbidden)
    stats = client.get("/v1/stats", headers=ADMIN).json()
    assert stats["errors"]["401 invalid_api_key"] >= 7 and stats["errors"]["401 missing_api_key"] >= 7


def test_a_memory_is_its_owners_alone_and_nobody_learns_what_another_stored(server):
    client, memory_dir, _, _ = server
    rows, _ = needle_questions(seed=21, memories=1)
    chunks = rows[0]["memory"]
    created = client.post("/v1/memories", json={"chunks": chunks})
    assert created.status_code == 201, created.text
    id = created.json()["id"]
    absent = "f" * 64
    for method, path, body in [("GET", "/v1/memories/{}", None), ("DELETE", "/v1/memories/{}", None),
                               ("POST", "/v1/completions", {"prompt": rows[0]["question"], "memory": "{}"})]:
        answers = []
        for target in (id, absent):
            sent = json.loads(json.dumps(body).replace("{}", target)) if body else None
            response = client.request(method, path.format(target), json=sent, headers=BOB)
            assert response.status_code == 404, (method, response.text)
            answers.append(message(response).replace(target, "ID"))
        assert answers[0] == answers[1]  # Alice's memory and no memory read the same to Bob
    # Bob sending Alice's text gets his own memory, with the status of a text never seen: nothing tells him she has it
    bobs = client.post("/v1/memories", json={"chunks": chunks}, headers=BOB)
    assert bobs.status_code == 201 and bobs.json()["source"] == "encoded" and bobs.json()["id"] != id
    assert client.get(f"/v1/memories/{id}").status_code == 200  # Bob's DELETE did not touch Alice's memory
    asked = client.post("/v1/completions", json={"prompt": rows[0]["question"], "memory": id, "max_tokens": 4})
    assert asked.status_code == 200, asked.text
    assert client.delete(f"/v1/memories/{bobs.json()['id']}", headers=BOB).status_code == 200
    assert client.get(f"/v1/memories/{id}").status_code == 200


def test_an_owners_memories_on_disk_have_a_budget(server):
    """Each key's memories on disk are bounded (memory_disk_mb_per_owner): past it, 413 naming the fix; another
    owner is not affected, and deleting makes room."""
    client, memory_dir, _, _ = server
    made, refused = [], None
    for i in range(40):
        response = client.post("/v1/memories", headers=BOB, json={"chunks": [f"k{i} = {i % 10} 1 2 ; " * 12,
                                                                      f"k{i + 50} = 3 {i % 10} 4 ; " * 12]})
        if response.status_code == 413:
            refused = response
            break
        assert response.status_code == 201, response.text
        made.append(response.json()["id"])
    assert refused is not None and made, "no memory was refused"
    assert "bytes each key may keep" in message(refused) and "DELETE /v1/memories" in message(refused)
    used = sum(f.stat().st_size for f in (memory_dir / owner_directory("bob")).rglob("*") if f.is_file())
    assert used <= DISK_MB_PER_OWNER * 2**20
    assert client.post("/v1/memories", json={"chunks": ["k1 = 5 5 5 ;"]}).status_code in (200, 201)  # Alice
    for id in made:
        assert client.delete(f"/v1/memories/{id}", headers=BOB).status_code == 200


def test_no_response_names_a_server_path(server, registered, checkpoint_root, mlflow_server):
    """Every response body and header, successes and errors alike: no memory directory, checkpoint or registry
    path; `model` is the registered name and version."""
    client, memory_dir, _, _ = server
    rows, _ = needle_questions(seed=23, memories=1)
    responses = [client.post("/v1/memories", json={"chunks": rows[0]["memory"]})]
    id = responses[0].json()["id"]
    question = {"prompt": rows[0]["question"], "memory": id, "max_tokens": 4}
    responses += [client.get(f"/v1/memories/{id}"), client.post("/v1/completions", json=question),
                  client.post("/v1/completions", json=question | {"stream": True}), client.get("/v1/models"),
                  client.get("/v1/stats", headers=ADMIN), client.get("/openapi.json"),
                  client.post("/v1/completions", json={"prompt": "k1 =", "memory": str(memory_dir)}),
                  client.post("/v1/completions", json={"prompt": "k1 =", "memory": "e" * 64}),
                  client.post("/v1/memories", json={"chunks": ["k1 = 2 ;" * 200]})]
    completion = responses[2].json()
    assert completion["model"] == f"{NAME}/1" and responses[4].json()["data"][0]["id"] == f"{NAME}/1"
    assert "checkpoint" not in responses[1].json()["encoder"] and responses[1].json()["encoder"]["hidden_size"] > 0
    paths = {str(memory_dir), str(checkpoint_root), str(Path(checkpoint_root).parent), "/tmp/", str(ROOT),
             mlflow_server.uri}
    for response in responses:
        seen = response.text + json.dumps(dict(response.headers))
        assert not [p for p in paths if p in seen], (response.request.url, seen[:500])


@pytest.mark.e2e
def test_without_keys_the_server_answers_loopback_only_and_refuses_to_listen_elsewhere(server, tmp_path,
                                                                                          monkeypatch):
    """No keys configured: `serve run` on loopback answers without a key and logs that it does; a server on any
    other host refuses to start, naming the fix. Keys from a file are read as from the environment."""
    import httpx

    client, _, restart, port = server
    with pytest.raises(ValueError, match="no API keys are configured and Serve's HTTP host is 0.0.0.0.*api_keys_file"):
        check_open_host("0.0.0.0", None)
    check_open_host("127.0.0.1", None)
    assert load_keys(None, None) is None
    check_open_host("0.0.0.0", [ApiKey("carol", "carol-key-0123456789abcdef")])
    key_file = tmp_path / "keys"
    key_file.write_text("# owner:key[:admin]\ncarol:carol-key-0123456789abcdef\nroot:root-key-0123456789abcdef:admin\n")
    keys = load_keys(str(key_file), None)
    assert [(k.owner, k.admin) for k in keys] == [("carol", False), ("root", True)]
    monkeypatch.setenv("SHORT_KEYS", "dave:short")
    with pytest.raises(ValueError, match="16 or more"):
        load_keys(None, "SHORT_KEYS")
    with pytest.raises(ValueError, match="does not set"):
        load_keys(None, "NOT_SET_ANYWHERE_42")
    assert KEYS["alice"] not in repr(keys) and "carol-key" not in repr(keys)  # keys never in a log line

    restart(api_keys_env=None)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as anonymous:
            assert anonymous.post("/v1/completions", json={"prompt": "k1 =", "max_tokens": 2}).status_code == 200
            assert anonymous.get("/v1/stats").status_code == 200
        # these replicas' own logs (by replica id: another Ray session on the machine may be the latest)
        ids = [name.rsplit("#", 1)[1] for name in _replicas()]
        files = {f.resolve() for id in ids  # session_latest too: a link
                 for f in Path("/tmp/ray").glob(f"session_*/logs/serve/replica_awareness_*_{id}.log")}
        assert len(files) == len(ids) >= 1, (ids, files)
        logs = "".join(f.read_text(errors="replace") for f in files)
        assert "no API keys configured: answering loopback clients only" in logs
    finally:
        restart()


# ------------------------------------------------------------------------------------------- bad input, bounds
def _greedy(client, prompt: str = "k1 =") -> str:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_every_bad_input_gets_a_clear_4xx_and_the_next_request_is_answered(server):
    """Each input that made a 500 (or was coerced, or unbounded) gets its 4xx with a message naming the problem,
    nothing is kept, and a normal request right after is answered as before."""
    client, _, _, _ = server
    expected = _greedy(client)
    encoded = client.get("/v1/stats", headers=ADMIN).json()["encoded"]
    cases = [  # (route, body, status, words in the message)
        ("/v1/memories", {"chunks": ["k1 = 2 ; " * 75]}, 413, "256 a chunk"),  # ~300 tokens: over the positions
        ("/v1/memories", {"chunks": ["k1 = \ud800 ;"]}, 422, "lone surrogate"),
        ("/v1/memories", {"files": [{"path": "a.py", "text": "x = '\ud800'"}]}, 422, "lone surrogate"),
        ("/v1/completions", {"prompt": "k1 \ud800"}, 422, "lone surrogate"),
        ("/v1/completions", {"prompt": "k1 \ud800", "stream": True}, 422, "lone surrogate"),
        ("/v1/completions", {"prompt": "k1 =", "stop": ["\udfff"]}, 422, "lone surrogate"),
        ("/v1/completions", {"prompt": "k1 =", "temperature": float("nan")}, 422, "temperature"),
        ("/v1/completions", {"prompt": "k1 =", "temperature": float("inf")}, 422, "temperature"),
        ("/v1/completions", {"prompt": "k1 =", "max_tokens": float("nan")}, 422, "max_tokens"),
        ("/v1/completions", {"prompt": "k1 =", "top_p": float("-inf")}, 422, "top_p"),
        ("/v1/memories", {"chunks": ["k1 = 2 ;"], "chunk_tokens": float("inf")}, 422, "chunk_tokens"),
        ("/v1/completions", {"prompt": "k1 =", "max_tokens": "4"}, 422, "max_tokens: Input should be a valid integer"),
        ("/v1/completions", {"prompt": "k1 =", "stream": 0}, 422, "stream: Input should be a valid boolean"),
        ("/v1/completions", {"prompt": "k1 =", "n": True}, 422, "n: Input should be a valid integer"),
        ("/v1/completions", {"prompt": ""}, 422, "prompt 0 is empty"),
        ("/v1/completions", {"prompt": "k1 =", "max_tokens": 0}, 422, "max_tokens"),
        ("/v1/completions", {"prompt": "k1 =", "logprobs": 2}, 422, "logprobs"),
        ("/v1/completions", {"prompt": "k1 =", "echo": True}, 422, "echo: Extra inputs are not permitted"),
        ("/v1/completions", {"prompt": "k1 =", "best_of": 2}, 422, "best_of"),
        ("/v1/completions", {"prompt": "k1 =", "logit_bias": {"5": 100}}, 422, "logit_bias"),
        ("/v1/completions", {"prompt": "k1 =", "user": "x"}, 422, "user"),
        ("/v1/completions", {"prompt": ["k1 =", "k2 ="], "stream": True}, 422, "one prompt with one choice"),
        ("/v1/completions", {"prompt": "k1 =", "model": "another"}, 404, "GET /v1/models"),
    ]
    for route, body, status, words in cases:
        response = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
        assert response.status_code == status, (body, response.text)
        assert words in message(response), (body, response.text)
        assert _greedy(client) == expected
    assert client.get("/v1/stats", headers=ADMIN).json()["encoded"] == encoded  # nothing was encoded for them

    for body in ({"prompt": "k1 =", "max_tokens": 4, "temperature": 5e-324},  # below MIN_TEMPERATURE: greedy
                 {"prompt": "k1 =", "max_tokens": 4, "temperature": 1e-30, "top_p": 1e-9}):
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == expected
        with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as streamed:
            events = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected

    big = client.post("/v1/memories", json={"chunks": ["k1 = 2 ;" * 150_000]})  # ~1.2 MB: over max_request_mb
    assert big.status_code == 413 and "max_request_mb" in message(big)

    def chunked():  # no Content-Length: the body is counted as it arrives
        yield b'{"chunks": ["'
        for _ in range(300):
            yield b"k1 = 2 ;" * 512
        yield b'"]}'

    streamed_big = client.post("/v1/memories", content=chunked(), headers={"content-type": "application/json"})
    assert streamed_big.status_code == 413 and "max_request_mb" in message(streamed_big)
    assert _greedy(client) == expected


@pytest.mark.e2e
def test_a_request_past_its_time_limit_ends_and_overload_answers_503_with_retry_after(server):
    """request_timeout_s bounds every generate: a plain request past it gets 504, a stream an error event and its
    end (no [DONE]); with max_ongoing_requests 1 and max_queued_requests 1 the requests beyond get Serve's 503 with
    Retry-After at once, and a normal request is answered after."""
    import concurrent.futures

    import httpx

    client, _, restart, port = server
    restart(request_timeout_s=1.5, max_ongoing_requests=1, max_queued_requests=1)
    try:
        slow = {"prompt": "k1 =", "max_tokens": 4096}  # greedy: this model's answer to "k1 =" never ends
        began = time.monotonic()
        plain = client.post("/v1/completions", json=slow)
        assert plain.status_code == 504 and "request_timeout_s" in message(plain), plain.text
        assert time.monotonic() - began < 30
        with client.stream("POST", "/v1/completions", json=slow | {"stream": True}) as streamed:
            events = [line[len("data: "):] for line in streamed.iter_lines() if line.startswith("data: ")]
        assert "[DONE]" not in events and json.loads(events[-1])["error"]["code"] == "timeout"

        def ask(_):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=ALICE) as own:
                response = own.post("/v1/completions", json=slow)
                return response.status_code, response.headers.get("retry-after")

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(ask, range(6)))
        assert any(status == 503 and retry for status, retry in outcomes), outcomes
        assert all(status in (503, 504) for status, _ in outcomes), outcomes
        assert client.post("/v1/completions", json={"prompt": "k1 =", "max_tokens": 2}).status_code == 200
    finally:
        restart()


@pytest.mark.e2e
def test_64_slow_or_broken_streams_do_not_stop_a_normal_request(server):
    """The issue's hang, 64 times at once: streams with temperature 5e-324 and max_tokens 4096 (greedy now, and this
    model's greedy answer to "k1 =" never ends, so each runs until its time limit); half never read a byte after the
    headers, half leave after their first event. They all decode in the replica's loop beside each other, so a
    normal request sent after them gets its answer (the same as alone) within a few times its usual latency; the
    unread streams were still decoding (their buffered events run on)."""
    import asyncio

    import httpx

    client, _, _, port = server
    expected = _greedy(client)
    began = time.perf_counter()
    assert _greedy(client) == expected
    usual = time.perf_counter() - began
    long = {"prompt": "k1 =", "max_tokens": 4096, "temperature": 5e-324, "stream": True}

    async def attack() -> tuple[float, float, str, int]:
        began = time.perf_counter()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=ALICE, timeout=120,
                                     limits=httpx.Limits(max_connections=80)) as http:
            opened = [http.stream("POST", "/v1/completions", json=long) for _ in range(64)]
            responses = await asyncio.gather(*(s.__aenter__() for s in opened))
            assert all(r.status_code == 200 for r in responses)
            for response in responses[32:]:  # broken: one event, then gone
                await anext(response.aiter_lines())
                await response.aclose()
            await asyncio.sleep(1.0)
            asked = time.perf_counter()
            answer = await http.post("/v1/completions", json={"prompt": "k1 =", "max_tokens": 4})
            took = time.perf_counter() - asked
            events = 0
            async for line in responses[0].aiter_lines():  # a slow one, read at last: it kept decoding
                if not line:
                    continue
                if not line.startswith('data: {"id"'):  # [DONE] or an error event (its time ran out)
                    break
                events += 1
                if events == 100:
                    break
            for s in opened[:32]:
                await s.__aexit__(None, None, None)
            assert answer.status_code == 200, answer.text
            return asked - began, took, answer.json()["choices"][0]["text"], events

    before, took, text, events = asyncio.run(attack())
    assert before < 30  # well inside the streams' 60 s time limit: they were all still decoding
    assert text == expected and took < max(10 * usual, 3.0), (took, usual)
    assert events == 100
    assert _greedy(client) == expected


# ------------------------------------------------------------------------------------------- OpenAI's wire format
def test_the_official_openai_client_completes_batches_streams_lists_models_and_reads_the_errors(server, pyfunc):
    """The `openai` package against the app as an OpenAI-speaking tool uses it: `memory` goes in extra_body (this
    server's extension); answers equal the pyfunc's; every response and stream event carries id, object, created
    and model; usage ends a stream when asked; a list of prompts is answered as a batch; seed, n and top_p are
    honoured; errors are OpenAI's shape, so the client's exception carries the server's message, code and field."""
    import openai

    client, _, _, port = server
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEYS["alice"], max_retries=0, timeout=60)
    (card,) = api.models.list().data
    assert card.id == f"{NAME}/1" and card.object == "model"
    rows, _ = needle_questions(seed=5, memories=1)
    memory = client.post("/v1/memories", json={"chunks": rows[0]["memory"]}).json()["id"]
    expected = [pyfunc.predict(row)[0] for row in rows[:3]]
    extra = {"memory": memory}

    done = api.completions.create(model=card.id, prompt=rows[0]["question"], extra_body=extra)
    assert done.id.startswith("cmpl-") and done.object == "text_completion" and done.model == card.id
    assert abs(done.created - time.time()) < 120 and done.choices[0].text == expected[0]
    assert done.usage.completion_tokens > 0 and done.usage.total_tokens == done.usage.prompt_tokens + \
        done.usage.completion_tokens
    batch = api.completions.create(model=card.id, prompt=[row["question"] for row in rows[:3]], extra_body=extra)
    assert [c.index for c in batch.choices] == [0, 1, 2] and [c.text for c in batch.choices] == expected

    events = list(api.completions.create(model=card.id, prompt=rows[0]["question"], stream=True,
                                         stream_options={"include_usage": True}, extra_body=extra))
    assert {(e.id, e.object, e.model, e.created) for e in events} == {(events[0].id, "text_completion", card.id,
                                                                      events[0].created)}
    assert "".join(e.choices[0].text for e in events if e.choices) == expected[0]
    assert events[-1].choices == [] and events[-1].usage.completion_tokens > 0
    assert all(e.usage is None for e in events[:-1])

    sampled = {"model": card.id, "prompt": "k1 =", "max_tokens": 6, "temperature": 1.0}
    first = api.completions.create(**sampled, seed=7, n=3)
    again = api.completions.create(**sampled, seed=7, n=3)
    assert len(first.choices) == 3 and [c.text for c in first.choices] == [c.text for c in again.choices]
    prompts = ["k1 =", "k2 ="]  # several prompts, n each: choice p * n + j is prompt p alone with seed + j
    several = api.completions.create(**(sampled | {"prompt": prompts}), seed=7, n=2)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    alone = [api.completions.create(**(sampled | {"prompt": p}), seed=7 + j).choices[0].text
             for p in prompts for j in range(2)]
    assert [c.text for c in several.choices] == alone
    assert alone[:2] == [c.text for c in first.choices[:2]]
    narrow = api.completions.create(**sampled, top_p=1e-9)  # only the likeliest token survives: the greedy answer
    assert narrow.choices[0].text == api.completions.create(model=card.id, prompt="k1 =", max_tokens=6).choices[0].text

    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model=card.id, prompt="k1 =", extra_body={"memory": "0" * 64})
    assert missing.value.code == "memory_not_found" and "POST /v1/memories" in missing.value.message
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        api.completions.create(model=card.id, prompt="k1 =", logprobs=2)
    assert refused.value.param == "logprobs" and "log probabilities" in refused.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        api.completions.create(model="gpt-4o", prompt="k1 =")
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError) as denied:
        openai.OpenAI(base_url=api.base_url, api_key="not-a-key-0123456789", max_retries=0).models.list()
    assert denied.value.code == "invalid_api_key"


# ------------------------------------------------------------------------------------------- the schema, counters
def test_the_schema_says_what_the_server_answers(server):
    """What schemathesis (test_schema.py) found, each fixed: statuses and the stream's media type undocumented (and
    FastAPI's own 422 shape documented instead of this app's), a 405 whose Allow named one of the path's methods, a
    body that is not UTF-8 answered with an undocumented 400, 4.0 (an integer to JSON Schema) refused as a float, and
    bodies that break the schema's rules (null chunks beside files, chunk_tokens with chunks, whitespace-only text by
    any dialect's definition) accepted, or valid ones refused."""
    client, _, _, _ = server
    schema = client.get("/openapi.json").json()
    operations = {(path, method): op["responses"] for path, methods in schema["paths"].items()
                  for method, op in methods.items()}
    assert {"200", "201", "400", "401", "409", "413", "422", "503"} <= set(operations["/v1/memories", "post"])
    completions = operations["/v1/completions", "post"]
    assert {"200", "400", "401", "404", "409", "413", "422", "503", "504"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "HTTPValidationError" not in json.dumps(schema) and schema["security"] == [{"bearer": []}]
    memory = schema["components"]["schemas"]["MemoryRequest"]
    assert "files" not in memory["properties"] and memory["required"] == ["chunks"]  # a needle model takes no files

    refused = client.request("OPTIONS", f"/v1/memories/{'0' * 64}")
    assert refused.status_code == 405 and refused.headers["allow"] == "DELETE, GET", refused.headers
    broken = client.post("/v1/completions", content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"})
    assert broken.status_code == 400 and message(broken)
    four = client.post("/v1/completions", json={"prompt": "k1 =", "max_tokens": 4.0, "seed": 7.0, "n": 1.0})
    assert four.status_code == 200, four.text
    for body in ({"prompt": "k1 =", "max_tokens": 4.5}, {"prompt": "\x1f \u3000"}, {"prompt": ["k1 ="] * 9}):
        assert client.post("/v1/completions", json=body).status_code == 422, body
    for body in ({"chunks": None, "files": [{"path": "a.py", "text": "x = 1"}]},
                 {"chunks": ["k1 = 2 ;"], "chunk_tokens": 64}, {"chunks": ["k1 = 2 ;", "\u2003\x1c"]}):
        assert client.post("/v1/memories", json=body).status_code == 422, body


def test_errors_are_counted_by_status_and_reason(monkeypatch):
    """ErrorCounts: GET /v1/stats' counts, and Ray Serve metrics tagged with the status and reason (a 401 also as a
    rejected key)."""
    import pipelines.serving.app as app_module

    made = {}

    class Recorded:
        def __init__(self, name, description, tag_keys):
            self.tag_keys, self.seen = tag_keys, []
            made[name] = self

        def inc(self, value=1.0, tags=None):
            self.seen.append(tags)

    monkeypatch.setattr(app_module.metrics, "Counter", Recorded)
    counts = app_module.ErrorCounts()
    counts.count(401, "invalid_api_key")
    counts.count(422, "invalid_request")
    counts.count(422, "invalid_request")
    assert counts.counts == {"401 invalid_api_key": 1, "422 invalid_request": 2}
    assert made["awareness_errors"].seen == [{"status": "401", "reason": "invalid_api_key"},
                                             {"status": "422", "reason": "invalid_request"}] + \
        [{"status": "422", "reason": "invalid_request"}]
    assert made["awareness_rejected_keys"].seen == [{"reason": "invalid_api_key"}]


def test_serve_metrics_count_4xx_by_reason_and_rejected_keys(server):
    """Live: a missing key, a wrong key and a bad field show up on the node's Prometheus endpoint (where Ray exports
    ray.serve.metrics) as ray_awareness_rejected_keys_total and ray_awareness_errors_total, tagged by reason."""
    import httpx
    import ray

    client, _, _, port = server
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as anonymous:
        assert anonymous.get("/v1/models").status_code == 401
        assert anonymous.get("/v1/models", headers={"Authorization": "Bearer not-a-key-0123456789"}).status_code == 401
    assert client.post("/v1/completions", json={"prompt": "k1 =", "max_tokens": "4"}).status_code == 422
    metrics_port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    wanted = {("ray_awareness_rejected_keys_total", 'reason="missing_api_key"'),
              ("ray_awareness_rejected_keys_total", 'reason="invalid_api_key"'),
              ("ray_awareness_errors_total", 'reason="invalid_request"')}
    deadline, seen = time.monotonic() + 90, set()
    while time.monotonic() < deadline and seen != wanted:  # Ray exports metrics every few seconds
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
        seen = {(name, tag) for name, tag in wanted for line in text.splitlines()
                if line.startswith(name + "{") and tag in line and float(line.rsplit(" ", 1)[1]) >= 1}
        time.sleep(2)
    assert seen == wanted, f"not exported within 90 s: {wanted - seen}"
