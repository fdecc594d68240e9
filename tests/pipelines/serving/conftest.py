"""The Serve app that tests/pipelines/serving/test_app.py and test_schema.py send requests to: a tiny export
registered in a real `mlflow server`, served from `models:/NAME@candidate` on loopback behind API keys (read from an
environment variable the config names). One app for the package: started by the first test that asks for it, shut down
after the package's last test."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.serving.loopback import free_port
from pipelines.serving.memories import owner_directory
from pipelines.serving.tiny import register_tiny_export

ROOT = Path(__file__).resolve().parents[3]
NAME = "awareness-serve-test"
KEYS_ENV = "AWARENESS_TEST_API_KEYS"
KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef", "root": "root-key-0123456789abcdef",
        "carol": "carol-key-0123456789abcdef"}  # carol: the schemathesis runs' owner, an admin (test_schema.py)
ALICE = {"Authorization": f"Bearer {KEYS['alice']}"}
BOB = {"Authorization": f"Bearer {KEYS['bob']}"}
ADMIN = {"Authorization": f"Bearer {KEYS['root']}"}
DISK_MB_PER_OWNER = 0.5


def stored(memory_dir: Path, id: str, owner: str = "alice") -> Path:
    """Where a memory of `owner` lives on the server's disk."""
    return memory_dir / owner_directory(owner) / id


def message(response) -> str:
    """The message of an error in OpenAI's shape ({"error": {"message", "type", "code"}})."""
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]["message"]


@pytest.fixture(scope="package")
def registered(tmp_path_factory, checkpoint_root, mlflow_server):
    register_tiny_export(tmp_path_factory.mktemp("serve-registry"), checkpoint_root, mlflow_server.uri, "serve-test",
                         NAME)
    return f"models:/{NAME}@candidate"


@pytest.fixture(scope="package")
def server(registered, mlflow_server, tmp_path_factory):
    """(an httpx client with Alice's key, the memory directory, restart(**changed args), the HTTP port)."""
    import httpx
    import ray
    from ray import serve

    from pipelines.serving.app import build

    memory_dir = tmp_path_factory.mktemp("memories")
    port = free_port()
    keys = f"alice:{KEYS['alice']},bob:{KEYS['bob']} root:{KEYS['root']}:admin carol:{KEYS['carol']}:admin"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", KEYS_ENV: keys}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": registered, "memory_dir": str(memory_dir), "tracking_uri": mlflow_server.uri,
            "max_memory_tokens": 400, "memory_budget_mb": 0.001,  # ~1 KB: one warm memory
            "api_keys_env": KEYS_ENV, "memory_disk_mb_per_owner": DISK_MB_PER_OWNER, "max_request_mb": 1}
    serve.run(build(args), name="awareness", route_prefix="/")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, headers=ALICE)

    def restart(**changes):  # new replicas (a restart): the cache starts empty, the disk store stays
        serve.run(build(args | changes), name="awareness", route_prefix="/")

    yield client, memory_dir, restart, port
    client.close()
    serve.shutdown()
    ray.shutdown()
