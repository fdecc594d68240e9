"""schemathesis over the live Serve app (conftest's `server`, on loopback): requests generated from the schema the
app itself serves (GET /openapi.json, as a key sees it), sent with Carol's key, every check on (`st run --checks
all`: no 5xx, every status, media type and body as documented, schema-invalid requests refused, schema-valid ones
accepted, OPTIONS and undeclared methods answered 405 with the right Allow). A bounded, seeded run in `make test-e2e`; a
longer one in the slow tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipelines.serving.conftest import KEYS

pytestmark = pytest.mark.ray
SEED = 44
# Rules the schema cannot state, each answered with a 413 (a memory's tokens, not characters, over max_memory_tokens,
# a chunk over the encoder's positions, an owner's disk budget): schemathesis takes a schema-valid request refused
# with 413 for a failure, and a schema-invalid one refused with 413 (e.g. over maxItems chunks) too.
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "401", "403", "404", "409", "413"]

[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]
"""


@pytest.fixture(scope="module")
def schema_server(server):
    """The package's app with a small max_tokens_limit (the schema says so), so that no generated completion (up to
    8 prompts, n 8) runs into request_timeout_s; put back after."""
    _, _, restart, port = server
    restart(max_tokens_limit=8)
    yield port
    restart()


def schemathesis(port: int, tmp_path: Path, max_examples: int, phases: str) -> subprocess.CompletedProcess:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [str(Path(sys.executable).with_name("st")), "--config-file", str(config), "--no-color", "run",
               f"http://127.0.0.1:{port}/openapi.json", "--header", f"Authorization: Bearer {KEYS['carol']}",
               "--checks", "all", "--seed", str(SEED), "--max-examples", str(max_examples), "--workers", "1",
               "--phases", phases, "--request-timeout", "60", "--report", "junit",
               "--report-junit-path", str(tmp_path / "junit.xml")]
    return subprocess.run(command, capture_output=True, text=True, timeout=1200, cwd=tmp_path, check=False)


def check(outcome: subprocess.CompletedProcess) -> None:
    print(outcome.stdout[-6000:])
    assert outcome.returncode == 0, outcome.stdout[-12000:] + outcome.stderr[-3000:]
    assert "No issues found" in outcome.stdout, outcome.stdout[-3000:]


@pytest.mark.e2e
def test_schemathesis_finds_no_server_error_and_no_schema_violation(schema_server, tmp_path):
    """Bounded: a few examples an operation, each phase once (~1 minute on 2 shared cores)."""
    check(schemathesis(schema_server, tmp_path, max_examples=10, phases="examples,coverage,fuzzing,stateful"))


@pytest.mark.slow
def test_schemathesis_at_length(schema_server, tmp_path):
    check(schemathesis(schema_server, tmp_path, max_examples=200, phases="examples,coverage,fuzzing,stateful"))
