"""benchmarks/serve_load.py as a user runs it: the dry run's plan (nothing started), and a real quick run (its own
registry, the Serve app and `mlflow models serve` on loopback, levels 1 and 4) whose report has both systems at each
level, no errors, every answer equal to the pyfunc's, and the JSON summary as its last line; its servers are gone
after."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "benchmarks/serve_load.py"


def run(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    """The script in a process of its own; on a timeout it gets SIGTERM first (it stops its servers on it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(f"{SCRIPT} {' '.join(args)} ran past {timeout} s: {stderr[-3000:]}")
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert done.returncode == 0, stderr[-3000:]
    return done, json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def serve_load():
    """The script as a module, its main run in this process (a process each costs ~15 s of imports)."""
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["serve_load"]


def test_the_dry_run_prints_the_plan_and_starts_nothing(serve_load, capsys, tmp_path):
    assert serve_load.main(["--dry-run", "--workdir", str(tmp_path / "w")]) is None
    out = capsys.readouterr().out
    plan = json.loads(out.strip().splitlines()[-1])
    assert plan["dry_run"] and plan["levels"] == [1, 4, 16, 64]
    assert plan["requests"] == {"1": 64, "4": 64, "16": 128, "64": 512}  # max(64, 8 * clients)
    ports = {plan["serve_port"], plan["mlflow_port"], plan["registry_port"]}
    assert len(ports) == 3 and all(str(p) in out for p in ports)
    commands = plan["commands"]
    assert "mlflow models serve -m models:/awareness-serve-load/VERSION --env-manager local --host 127.0.0.1" in (
        commands["mlflow"]) and "mlflow server --host 127.0.0.1" in commands["registry"]
    assert "serve.start(http_options={'host': '127.0.0.1'" in commands["serve"]
    assert not (tmp_path / "w").exists()  # nothing made, nothing started
    serve_load.main(["--dry-run", "--quick", "--model", "models:/awareness@candidate", "--tracking-uri",
                     "http://127.0.0.1:5000"])
    quick = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert quick["levels"] == [1, 4] and quick["requests"] == {"1": 8, "4": 8} and quick["registry_port"] is None
    assert "models:/awareness@candidate" in quick["commands"]["mlflow"]


def test_direct_ingress_pins_the_replicas_port_and_the_clients_go_there(serve_load, capsys):
    """--ingress direct: Ray Serve's direct ingress on, its HTTP port range exactly the plan's port (Serve's range
    excludes its end), and that port is where the Serve clients go; without it, Serve's proxy port."""
    serve_load.main(["--quick", "--ingress", "direct", "--dry-run"])
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    port = plan["direct_port"]
    assert port and port not in (plan["serve_port"], plan["mlflow_port"], plan["registry_port"])
    assert plan["commands"]["serve"].startswith(
        f"RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT={port} "
        f"RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT={port + 1}; ray.init(")
    direct = serve_load.Plan(**{k: v for k, v in plan.items() if k not in ("dry_run", "benchmark")})
    assert serve_load.serve_url(direct) == f"http://127.0.0.1:{port}"
    proxied = serve_load.Plan(**{**{k: v for k, v in plan.items() if k not in ("dry_run", "benchmark")},
                                 "direct_port": None})
    assert serve_load.serve_url(proxied) == f"http://127.0.0.1:{plan['serve_port']}"
    assert serve_load.direct_ingress_env(proxied) == {}


def test_the_documented_commands_dry_run(serve_load, capsys):
    """docs/benchmarks.md and docs/serving.md show `python benchmarks/serve_load.py ...`: each parses and plans."""
    text = "".join((ROOT / "docs" / name).read_text() for name in ("benchmarks.md", "serving.md"))
    commands = set(re.findall(r"python benchmarks/serve_load\.py([^\n`]*)", text))
    assert len(commands) >= 4
    for rest in commands:
        args = [a for a in rest.split() if a != "--dry-run"]
        assert serve_load.main([*args, "--dry-run"]) is None
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dry_run"], rest


@pytest.mark.parametrize("device, gpus", [("cuda", 1), ("cuda:0", 1), ("cpu", 0), ("auto", 0)])
def test_a_replica_asks_for_a_gpu_exactly_when_the_model_is_placed_on_one(serve_load, capsys, device, gpus):
    """Planned on this machine (no GPU) for a GPU box: the Serve replica's num_gpus follows the pyfunc's own placement
    (`auto` is the CPU here), and both servers are told the same placement."""
    serve_load.main(["--quick", "--device", device, "--dtype", "bfloat16", "--dry-run"])
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["gpus"] == gpus and ("'num_gpus': 1" in plan["commands"]["serve"]) == bool(gpus)
    assert f"device='{device}', dtype='bfloat16'" in plan["commands"]["serve"]
    assert f'"device": "{device}", "dtype": "bfloat16"' in plan["commands"]["mlflow"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("ingress", ["proxy", "direct"])
def test_a_quick_run_reports_both_systems_with_no_errors_and_the_pyfuncs_answers(tmp_path, ingress):
    done, report = run("--quick", "--workdir", str(tmp_path / "w"), "--ingress", ingress, timeout=600)
    assert report["ingress"] == ingress and bool(report["ports"]["direct"]) == (ingress == "direct")
    assert report["benchmark"] == "serve_load" and re.fullmatch(r"models:/awareness-serve-load/\d+", report["model"])
    assert [row["concurrency"] for row in report["levels"]] == [1, 4]
    for row in report["levels"]:
        for system in ("serve", "serve_stream", "mlflow"):
            measured = row[system]
            assert measured["requests"] == measured["ok"] == 8 and measured["errors"] == 0
            assert measured["mismatches"] == 0  # every answer is the pyfunc's predict for that question
            assert measured["rps"] > 0 and 0 < measured["p50_ms"] <= measured["p99_ms"]
            assert 0 < measured["ttft_p50_ms"] <= measured["p50_ms"]
        assert row["mlflow"]["ttft_p50_ms"] == row["mlflow"]["p50_ms"]  # no streaming: its TTFT is its latency
        assert row["serve"]["batching"]["steps"] >= 1 and row["rps_ratio"] > 0
    assert report["errors"] == 0 and report["mismatches"] == 0
    assert all(c == {"asked": 8, "errors": 0, "mismatches": 0} for c in report["correctness"].values())
    tables = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert tables[0].startswith("| clients | Serve req/s | mlflow req/s | Serve / mlflow |")
    assert [t.split("|")[1].strip() for t in tables[2:4]] == ["1", "4"]  # a row per level, both systems side by side
    assert tables[4].startswith("| clients | system | req/s | replica ms") and len(tables) == 4 + 2 + 6
    for row in report["levels"]:  # the CPU each of this run's processes spent per request
        assert row["serve"]["cpu"]["ms_per_request"]["serve_replica"] > 0
        assert row["mlflow"]["cpu"]["ms_per_request"]["mlflow_server"] > 0
    assert "c=4 mlflow:" in done.stderr  # progress per level on stderr
    for port in filter(None, report["ports"].values()):  # its servers are gone: none of its ports answers
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still answers"
