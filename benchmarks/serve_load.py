"""Load test: one registered version served two ways on loopback, side by side in one run, under the same questions
at rising concurrency (issue 27).

    python benchmarks/serve_load.py                     (its own setup: a tiny needle model in a local registry)
    python benchmarks/serve_load.py --model models:/awareness@candidate --tracking-uri http://127.0.0.1:5000
    python benchmarks/serve_load.py --quick             (levels 1 and 4, a few requests: what the test runs)
    python benchmarks/serve_load.py --dry-run           (the plan: levels, requests, ports, commands; starts nothing)
    python benchmarks/serve_load.py --model EXPORT --device cuda --dtype bfloat16 --serve-only   (a GPU replica)
    python benchmarks/serve_load.py --ingress direct    (clients reach the replica itself, not Serve's HTTP proxy)

(a) The Ray Serve application (pipelines/serving/app.py), started in this process on a local Ray: the memory created
once with POST /v1/memories, every question a POST /v1/completions naming it (`memory: id`), behind an API key (the
app's `api_keys_env`, a key made for the run; every request sends it). Two passes per level: plain requests
(requests/s and latency) and `stream: true` requests (time to the first server-sent `data:` event); both go through
the replica's continuous batching (pipelines/serving/decoding.py), which admits new questions at every decoding
step. `--ingress direct`
turns on Ray Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS, experimental in Ray 2.60): the ingress replica
runs its own HTTP server, on a port pinned here, and clients skip the proxy's hop (docs/serving.md, "Direct ingress").
(b) `mlflow models serve -m models:/NAME/VERSION --env-manager local` of the same version, a subprocess, each question
one POST /invocations of one row. MLflow has no streaming: its time to first token is its latency.

The fair recipe for mlflow. A pyfunc row can carry the memory as chunk texts, and then every request runs the encoder
over the whole memory, while Serve encodes a memory once when it is created. That would measure re-encoding, not
serving. The pyfunc's own way to avoid it is a memory store: the same chunks encoded once, in advance, by the model's
encoder into the store format jobs/encode_memory.py writes (AwarenessPyfunc.write_store, the same encode path as
Serve's POST /v1/memories), and each row names it (`memory_store`). The pyfunc keeps the last store it read, so the
store is read from disk once and every request pays only for the decoder. What remains different is the design
being measured: Serve also keeps each GCA layer's memory keys/values (computed once per memory) and decodes
questions from different clients as one batch, while the pyfunc projects the memory and computes its
keys/values inside every generate and mlflow answers one request per predict call (its requests run concurrently in
threads over one model). Both sides get one model copy (one Serve replica, `--workers 1`) and the same torch
threads (`--threads`, OMP_NUM_THREADS for both processes). Requests go round the needle questions of one memory.

Correctness in the same run: every answer from both servers (plain and streamed) is compared with the pyfunc's
`predict` in this process for the same question over the chunk texts; a mismatch is counted and reported (and the
JSON summary's `mismatches` is their total).

Without --model it makes its own setup: random tiny checkpoints, an `mlflow server` (SQLite in a temporary
directory), and the tiny export with open gates registered there (pipelines.serving.tiny). `--model` takes
`models:/NAME@ALIAS` or `models:/NAME/VERSION` (with `--tracking-uri`; an alias is resolved to its version once, so both
servers serve the same version), or an export directory (registered into a local `mlflow server`, as a needle run).
`--device` / `--dtype` place the model in both servers and in this process (pipelines.serving.pyfunc.placement); a
GPU gives the Serve replica `num_gpus: 1` (pipelines/serving/awareness-gpu.yaml) and mlflow its
MLFLOW_PYFUNC_INFERENCE_CONFIG. `--serve-only` leaves mlflow out (a GPU box without MLflow's server): an export is then
served as a directory, no registry, and the reference answers are the same pyfunc's in this process.
Prints a markdown table on stdout, progress on stderr, and a one-line JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NAME = "awareness-serve-load"  # the registered model of the self-made setup
QUESTION_SEED = 5  # needle questions as tests/pipelines/serving/test_app.py asks them
KEYS_ENV = "AWARENESS_LOAD_API_KEYS"  # the Serve app reads the run's key from it (api_keys_env)


@dataclass
class Plan:
    """What one run does; printed by --dry-run."""

    model: str  # models:/NAME/VERSION, models:/NAME@ALIAS (resolved at start), an export, or "" (own setup)
    tracking_uri: str | None
    levels: list[int]
    requests: dict[int, int]  # concurrency -> requests per system
    time_limit_s: float  # per level and system: no new request after it
    request_timeout_s: float
    threads: int
    max_batch_size: int
    workdir: str
    serve_port: int  # Serve's HTTP proxy
    mlflow_port: int | None  # mlflow models serve; None with --serve-only
    registry_port: int | None  # the own `mlflow server`, when one is started
    device: str = "auto"
    dtype: str = "auto"
    gpus: int = 0  # the Serve replica's num_gpus (1 when the model is placed on a GPU)
    direct_port: int | None = None  # --ingress direct: the replica's own HTTP port, where the clients go
    commands: dict[str, str] = field(default_factory=dict)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="models:/NAME@ALIAS, models:/NAME/VERSION or an export directory "
                                               "(default: register a tiny needle export in a local mlflow server)")
    p.add_argument("--tracking-uri", default=None, help="the registry of a models:/ --model (else MLFLOW_TRACKING_URI)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64], help="concurrent clients per level")
    p.add_argument("--requests", type=int, default=0, help="requests per level and system (default max(64, 8*c))")
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per level and system")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each server (and this process)")
    p.add_argument("--max-batch-size", type=int, default=128,
                   help="the Serve app's max_batch_size: rows decoding at once")
    p.add_argument("--device", default="auto",
                   help="where both servers place the model: auto (a GPU if seen), cpu, cuda")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoints' own), float32, bfloat16 or float16")
    p.add_argument("--ingress", choices=["proxy", "direct"], default="proxy",
                   help="how clients reach the Serve replica: through Serve's HTTP proxy (the default) or straight "
                        "to the replica's own HTTP server (Ray Serve's direct ingress, experimental)")
    p.add_argument("--serve-only", action="store_true", help="no mlflow: the Serve app alone, an export served as a "
                                                             "directory (for a box without MLflow's server)")
    p.add_argument("--workdir", default=None, help="where the setup, memory store and logs go (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="levels 1 and 4, 8 requests each, 60 s a level")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit without starting anything")
    args = p.parse_args(argv)
    if args.quick:
        args.levels, args.requests, args.time_limit = [1, 4], args.requests or 8, min(args.time_limit, 60.0)
    problems = [f"--levels {c}: at least 1" for c in args.levels if c < 1]
    problems += ["--requests: at least 1"] if args.requests < 0 else []
    problems += ["--model models:/...: give --tracking-uri or set MLFLOW_TRACKING_URI"] if (
        args.model.startswith("models:/") and not (args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))) else []
    problems += [f"--model {args.model}: no such export directory"] if (
        args.model and not args.model.startswith("models:/") and not Path(args.model).is_dir()) else []
    problems += ["--serve-only takes an export directory or nothing, not models:/ (it starts no registry client)"] if (
        args.serve_only and args.model.startswith("models:/")) else []
    if problems:
        p.error("; ".join(problems))
    from pipelines.serving.pyfunc import placement

    try:  # a dry run plans a GPU run on a machine without one
        placement("cpu" if args.dry_run else args.device, args.dtype)
    except ValueError as error:
        p.error(str(error))
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    from pipelines.serving.loopback import MlflowServer, ModelServer, free_port
    from pipelines.serving.pyfunc import placed_device

    # a dry run names the directory a run would make, without making it
    workdir = args.workdir or (str(Path(tempfile.gettempdir()) / "serve-load-XXXXXX") if args.dry_run
                               else tempfile.mkdtemp(prefix="serve-load-"))
    tracking = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    own_registry = not args.model.startswith("models:/") and not args.serve_only
    registry = MlflowServer(Path(workdir) / "mlflow", free_port()) if own_registry else None
    if args.serve_only:
        model = args.model or f"{workdir}/export"
    else:
        model = args.model if args.model.startswith("models:/") else f"models:/{NAME}/VERSION"
    gpus = int(placed_device(args.device).type == "cuda")
    plan = Plan(model=args.model, tracking_uri=registry.uri if registry else tracking, levels=list(args.levels),
                requests={c: args.requests or max(64, 8 * c) for c in args.levels}, time_limit_s=args.time_limit,
                request_timeout_s=args.request_timeout, threads=args.threads, max_batch_size=args.max_batch_size,
                workdir=workdir, serve_port=free_port(),
                mlflow_port=None if args.serve_only else free_port(), registry_port=registry.port if registry else None,
                device=args.device, dtype=args.dtype, gpus=gpus,
                direct_port=free_port() if args.ingress == "direct" else None)
    if registry:
        plan.commands["registry"] = shlex.join(registry.command)
    if not args.serve_only:
        served = ModelServer(model, plan.tracking_uri or "", Path(workdir) / "mlflow-serve", port=plan.mlflow_port)
        plan.commands["mlflow"] = (f"OMP_NUM_THREADS={args.threads} MLFLOW_TRACKING_URI={plan.tracking_uri} "
                                   f"MLFLOW_PYFUNC_INFERENCE_CONFIG='{json.dumps(placement_config(plan))}' "
                                   + shlex.join(served.command))
    plan.commands["serve"] = (" ".join(f"{k}={v}" for k, v in direct_ingress_env(plan).items())
                              + ("; " if plan.direct_port else "")
                              + f"ray.init(address='local', num_cpus={os.cpu_count()}); serve.start(http_options="
                              f"{{'host': '127.0.0.1', 'port': {plan.serve_port}}}); serve.run(AwarenessServer.options("
                              f"ray_actor_options={replica_options(plan)}).bind(model='{model}', memory_dir="
                              f"'{workdir}/memories', max_batch_size={args.max_batch_size}, api_keys_env='{KEYS_ENV}', "
                              f"device='{args.device}', dtype='{args.dtype}'))")
    return plan


def direct_ingress_env(plan: Plan) -> dict[str, str]:
    """Ray Serve's direct ingress, its HTTP port pinned to the plan's (one replica; its gRPC server keeps Ray's range):
    read by Serve's controller and replicas when they start, so it is in the environment Ray starts with."""
    if plan.direct_port is None:
        return {}
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(plan.direct_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(plan.direct_port + 1)}  # Serve's range excludes its end


def serve_url(plan: Plan) -> str:
    """Where the Serve clients go: the replica itself with direct ingress, else Serve's HTTP proxy."""
    return f"http://127.0.0.1:{plan.direct_port or plan.serve_port}"


def placement_config(plan: Plan) -> dict[str, str]:
    """The pyfunc's placement settings (pipelines.serving.pyfunc.PLACEMENT) as this run asks for them."""
    return {"device": plan.device, "dtype": plan.dtype}


def replica_options(plan: Plan) -> dict[str, float]:
    """The Serve replica's ray_actor_options: a GPU of its own when the model is placed on one."""
    return {"num_cpus": 1, **({"num_gpus": plan.gpus} if plan.gpus else {})}


def progress(line: str) -> None:
    print(f"[serve_load {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- setup
def resolve_version(model: str, tracking_uri: str) -> str:
    """models:/NAME@ALIAS -> models:/NAME/VERSION (what both servers load); models:/NAME/VERSION as it is."""
    from mlflow.tracking import MlflowClient

    name, _, alias = model[len("models:/"):].partition("@")
    if not alias:
        return model
    version = MlflowClient(tracking_uri).get_model_version_by_alias(name, alias).version
    return f"models:/{name}/{version}"


def setup_model(plan: Plan, stack: ExitStack):
    """(the models:/NAME/VERSION both servers load, the `mlflow server` started here or None): the given version, or
    an export (given or the tiny one) registered into an `mlflow server` started here (stopped by `stack`)."""
    from pipelines.serving.loopback import MlflowServer
    from pipelines.serving.tiny import register_export, tiny_export

    if plan.model.startswith("models:/"):
        return resolve_version(plan.model, plan.tracking_uri), None
    workdir = Path(plan.workdir)
    if plan.mlflow_port is None:  # --serve-only: the export itself, no registry
        if plan.model:
            return plan.model, None
        from models import PAIRS, write_random_checkpoints

        write_random_checkpoints(PAIRS["tiny"], workdir / "checkpoints")
        tiny_export(workdir / "export", workdir / "checkpoints")
        return str(workdir / "export"), None
    progress(f"starting mlflow server on 127.0.0.1:{plan.registry_port}")
    registry = stack.enter_context(MlflowServer(workdir / "mlflow", plan.registry_port))
    export = Path(plan.model) if plan.model else workdir / "export"
    if not plan.model:
        from models import PAIRS, write_random_checkpoints

        write_random_checkpoints(PAIRS["tiny"], workdir / "checkpoints")
        tiny_export(export, workdir / "checkpoints")
    version, _ = register_export(export, registry.uri, "serve-load", NAME)
    return f"models:/{NAME}/{version.version}", registry


def start_serve(plan: Plan, model: str, key: str, stack: ExitStack) -> None:
    """The Serve app on a local Ray of its own (never an existing cluster), torn down by `stack`, answering to `key`
    (an admin key: GET /v1/stats)."""
    import ray
    from ray import serve

    from pipelines.serving.app import AwarenessServer

    # this repository first, then whatever this process was given (a GPU box's bundled site, benchmarks/gpu_check.py)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(plan.threads),
           **({"MLFLOW_TRACKING_URI": plan.tracking_uri} if plan.tracking_uri else {}), **direct_ingress_env(plan),
           KEYS_ENV: f"load:{key}:admin"}
    os.environ.update(direct_ingress_env(plan))  # Serve's controller reads it at start, in the Ray this process starts
    ray.init(address="local", num_cpus=os.cpu_count(), num_gpus=plan.gpus, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": env})
    stack.callback(ray.shutdown)
    stack.callback(serve.shutdown)  # runs first (last in, first out)
    serve.start(http_options={"host": "127.0.0.1", "port": plan.serve_port})
    app = AwarenessServer.options(ray_actor_options=replica_options(plan)).bind(
        model=model, memory_dir=str(Path(plan.workdir) / "memories"), tracking_uri=plan.tracking_uri,
        max_batch_size=plan.max_batch_size, api_keys_env=KEYS_ENV, device=plan.device, dtype=plan.dtype)
    try:
        serve.run(app, name="serve-load", route_prefix="/")
    except RuntimeError as error:  # Serve says only that the deployment failed; its status holds the replica's error
        status = serve.status().applications.get("serve-load")
        why = [d.message for d in status.deployments.values()] if status else []
        raise RuntimeError(f"{error}: {' | '.join(why) or 'no deployment status'}") from error


# ---------------------------------------------------------------------------------------------- clients
@dataclass
class Outcome:
    latency: float  # seconds, request sent to response read
    ttft: float  # seconds to the first data event (stream), else the latency
    answer: str | None  # None: an error
    error: str = ""


class ServeClient:
    def __init__(self, url: str, memory: str, stream: bool):
        self.url, self.memory, self.stream = url, memory, stream

    async def ask(self, client, question: str) -> Outcome:
        body = {"prompt": question, "memory": self.memory, "stream": self.stream}
        start = time.perf_counter()
        if not self.stream:
            response = await client.post(f"{self.url}/v1/completions", json=body)
            latency = time.perf_counter() - start
            if response.status_code != 200:
                return Outcome(latency, latency, None, f"{response.status_code} {response.text[:200]}")
            return Outcome(latency, latency, response.json()["choices"][0]["text"])
        first, text = None, ""
        async with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                latency = time.perf_counter() - start
                return Outcome(latency, latency, None, f"{response.status_code} {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                first = first or time.perf_counter() - start
                if line == "data: [DONE]":
                    break
                text += json.loads(line[len("data: "):])["choices"][0]["text"]
        latency = time.perf_counter() - start
        return Outcome(latency, first or latency, text)


class MlflowModelClient:
    def __init__(self, url: str, store: str):
        self.url, self.store = url, store

    async def ask(self, client, question: str) -> Outcome:
        body = {"dataframe_records": [{"question": question, "memory_store": self.store}]}
        start = time.perf_counter()
        response = await client.post(f"{self.url}/invocations", json=body)
        latency = time.perf_counter() - start
        if response.status_code != 200:
            return Outcome(latency, latency, None, f"{response.status_code} {response.text[:200]}")
        return Outcome(latency, latency, response.json()["predictions"][0])


async def ask_safely(system, client, question: str) -> Outcome:
    start = time.perf_counter()
    try:
        return await system.ask(client, question)
    except Exception as error:  # noqa: BLE001 - a failed request is a counted error, not the end of the run
        latency = time.perf_counter() - start
        return Outcome(latency, latency, None, f"{type(error).__name__}: {error}"[:200])


# ---------------------------------------------------------------------------------------------- where the CPU goes
RAY_ROLES = {"ray::ProxyActor": "serve_proxy", "ray::ServeReplica": "serve_replica",
             "ray::ServeController": "serve_controller"}


def cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) so far of this process ("client": the load generator, and the idle Ray driver)
    and of every process it started, by role: the Serve proxy, replica and controller (Ray names their processes
    ray::ProxyActor, ...), the rest of its Ray (raylet, GCS, idle workers), and each subprocess tree in `roots`
    (role -> pid: mlflow models serve, the registry). Only this run's processes: descendants of this one."""
    import psutil

    me = psutil.Process()
    owner: dict[int, str] = {}
    for role, pid in roots.items():
        try:
            root = psutil.Process(pid)
            owner |= {p.pid: role for p in [root, *root.children(recursive=True)]}
        except psutil.Error:
            continue
    times = me.cpu_times()
    out = {"client": times.user + times.system}
    for process in me.children(recursive=True):
        try:
            title = process.cmdline()[0] if process.cmdline() else ""
            times = process.cpu_times()
        except psutil.Error:  # ended in between
            continue
        role = owner.get(process.pid) or next((r for prefix, r in RAY_ROLES.items() if title.startswith(prefix)),
                                              "ray_other")
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out


class CpuClock:
    """CPU time by role, and the machine's busy share (every process on it, other users' included), over a pass."""

    def __init__(self, roots: dict[str, int]):
        import psutil

        self.roots, self.start, self.wall = roots, cpu_seconds(roots), time.perf_counter()
        self.machine = psutil.cpu_times()

    def per_request(self, requests: int) -> dict[str, Any]:
        import psutil

        now, wall = cpu_seconds(self.roots), time.perf_counter() - self.wall
        spent = {role: now[role] - self.start.get(role, 0.0) for role in now}
        machine = psutil.cpu_times()
        busy = [(sum(b) - b.idle - getattr(b, "iowait", 0.0)) - (sum(a) - a.idle - getattr(a, "iowait", 0.0))
                for a, b in [(self.machine, machine)]][0]
        cores = psutil.cpu_count() or 1
        return {"ms_per_request": {role: round(s / max(requests, 1) * 1000, 2) for role, s in sorted(spent.items())
                                   if s > 0.0005},
                "ours_cores": round(sum(spent.values()) / wall, 2), "machine_busy_cores": round(busy / wall, 2),
                "cores": cores}


def generate_ms(pyfunc, store: Path, questions: list[str], batch: int, repeats: int = 15) -> float:
    """Median ms of one greedy generate of `batch` questions over the store's memory prepared once, in this process:
    what the Serve replica runs per batch (AwarenessServer._generate), without its server around it."""
    import statistics

    import torch

    from models.awareness import allowing_memory_keyword
    from pipelines.memory.store import MemoryStore

    model = pyfunc.model
    states, mask = MemoryStore(store).memory(device=model.device, chunked=bool(model.reading.top_k))
    memory = model.prepare_memory(memory_states=states, memory_states_mask=mask)
    ids = torch.tensor([pyfunc.tokenizer.encode(questions[i % len(questions)]).ids for i in range(batch)],
                       device=model.device)
    times = []
    for _ in range(repeats + 2):  # two untimed
        began = time.perf_counter()
        with torch.no_grad(), allowing_memory_keyword(model.decoder):
            model.decoder.generate(input_ids=ids, gca_memory=memory, max_new_tokens=pyfunc.max_new_tokens,
                                   eos_token_id=pyfunc.eos_token_id, pad_token_id=pyfunc.pad_token_id,
                                   do_sample=False)
        times.append(time.perf_counter() - began)
    return round(statistics.median(times[2:]) * 1000, 2)


# ---------------------------------------------------------------------------------------------- one level
def percentile_ms(values: list[float], q: float) -> float | None:
    import numpy as np

    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


async def run_level(system, client, concurrency: int, requests: int, time_limit: float, questions: list[str],
                    expected: dict[str, str]) -> dict[str, Any]:
    """`concurrency` clients take the next question until `requests` are sent or `time_limit` has passed."""
    outcomes: list[tuple[str, Outcome]] = []
    sent = 0
    start = time.perf_counter()

    async def worker():
        nonlocal sent
        while sent < requests and time.perf_counter() - start < time_limit:
            question = questions[sent % len(questions)]
            sent += 1
            outcomes.append((question, await ask_safely(system, client, question)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    ok = [(q, o) for q, o in outcomes if o.answer is not None]
    errors = [o.error for _, o in outcomes if o.answer is None]
    return {"requests": len(outcomes), "ok": len(ok), "errors": len(errors), "error_sample": errors[:1],
            "cut_by_time_limit": sent < requests, "seconds": round(seconds, 3),
            "rps": round(len(ok) / seconds, 2) if seconds else 0.0,
            "p50_ms": percentile_ms([o.latency for _, o in ok], 50),
            "p99_ms": percentile_ms([o.latency for _, o in ok], 99),
            "ttft_p50_ms": percentile_ms([o.ttft for _, o in ok], 50),
            "ttft_p99_ms": percentile_ms([o.ttft for _, o in ok], 99),
            "mismatches": sum(o.answer != expected[q] for q, o in ok)}


def batching_delta(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """What the replica did during one pass (GET /v1/stats' `batching`, after minus before)."""
    b, a = before["batching"], after["batching"]
    steps, rows = a["steps"] - b["steps"], a["rows"] - b["rows"]
    sizes = {k: v - b["sizes"].get(k, 0) for k, v in a["sizes"].items() if v - b["sizes"].get(k, 0)}
    forward_s = a["forward_s"] - b["forward_s"]
    return {"steps": steps, "mean_batch": round(rows / steps, 2) if steps else None,
            "batch_sizes": dict(sorted(sizes.items(), key=lambda kv: int(kv[0]))),
            "prefills": a["prefills"] - b["prefills"], "forwards": a["forwards"] - b["forwards"],
            "forward_s": round(forward_s, 3), "forward_share": round(forward_s / seconds, 3) if seconds else None}


async def run_levels(plan: Plan, systems: dict[str, Any], questions: list[str], expected: dict[str, str],
                     roots: dict[str, int], headers: dict[str, str]):
    import httpx

    limits = httpx.Limits(max_connections=max(plan.levels), max_keepalive_connections=max(plan.levels))
    rows = []
    async with httpx.AsyncClient(limits=limits, timeout=plan.request_timeout_s, headers=headers) as client:
        stats_url = f"{systems['serve'].url}/v1/stats"
        check = {name: [await ask_safely(system, client, q) for q in questions] for name, system in systems.items()}
        correctness = {name: {"asked": len(out), "errors": sum(o.answer is None for o in out),
                              "mismatches": sum(o.answer is not None and o.answer != expected[q]
                                                for q, o in zip(questions, out))} for name, out in check.items()}
        progress(f"correctness pass (each question once, sequential; also the warm-up): {correctness}")
        for concurrency in plan.levels:
            row: dict[str, Any] = {"concurrency": concurrency}
            for name, system in systems.items():  # in turns at each level: drifting background load hits all three
                before, cpu = (await client.get(stats_url)).json(), CpuClock(roots)
                row[name] = await run_level(system, client, concurrency, plan.requests[concurrency],
                                            plan.time_limit_s, questions, expected)
                row[name]["cpu"] = cpu.per_request(row[name]["ok"])
                if name.startswith("serve"):
                    row[name]["batching"] = batching_delta(before, (await client.get(stats_url)).json(),
                                                           row[name]["seconds"])
                r = row[name]
                progress(f"c={concurrency} {name}: {r['ok']}/{r['requests']} ok, {r['rps']} req/s, p50 {r['p50_ms']} "
                         f"ms, p99 {r['p99_ms']} ms, ttft p50 {r['ttft_p50_ms']} ms, errors {r['errors']}, "
                         f"mismatches {r['mismatches']}" + (f", {r['error_sample'][0]}" if r["errors"] else ""))
            mlflow_rps = row.get("mlflow", {}).get("rps")
            row["rps_ratio"] = round(row["serve"]["rps"] / mlflow_rps, 2) if mlflow_rps else None
            rows.append(row)
    return correctness, rows


# ---------------------------------------------------------------------------------------------- report
def table(rows: list[dict[str, Any]]) -> str:
    def pair(r, a, b):
        return f"{r[a]} / {r[b]}"

    lines = ["| clients | Serve req/s | mlflow req/s | Serve / mlflow | Serve p50 / p99 ms | mlflow p50 / p99 ms | "
             "Serve TTFT p50 / p99 ms (stream) | mlflow TTFT p50 / p99 ms (= latency) | Serve stream req/s | "
             "mean batch | errors S / stream / M |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    absent = {"rps": "-", "p50_ms": "-", "p99_ms": "-", "ttft_p50_ms": "-", "ttft_p99_ms": "-", "errors": "-"}
    for row in rows:
        s, t, m = row["serve"], row["serve_stream"], row.get("mlflow", absent)  # absent: --serve-only
        lines.append(f"| {row['concurrency']} | {s['rps']} | {m['rps']} | {row['rps_ratio']} | "
                     f"{pair(s, 'p50_ms', 'p99_ms')} | {pair(m, 'p50_ms', 'p99_ms')} | "
                     f"{pair(t, 'ttft_p50_ms', 'ttft_p99_ms')} | {pair(m, 'ttft_p50_ms', 'ttft_p99_ms')} | "
                     f"{t['rps']} | "
                     f"{s['batching']['mean_batch']} | {s['errors']} / {t['errors']} / {m['errors']} |")
    return "\n".join(lines)


def cpu_table(rows: list[dict[str, Any]]) -> str:
    """Where the CPU goes: per request, each role's CPU ms (Serve's replica with the wall ms its decoder forwards
    took per request), and how many of the machine's cores this run's processes and all processes kept busy."""
    lines = ["| clients | system | req/s | replica ms (in forwards) | proxy ms | mlflow server ms | client ms | "
             "Ray rest ms | cores busy: this run / machine |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for name in [n for n in ("serve", "serve_stream", "mlflow") if n in row]:
            r = row[name]
            ms, cpu = r["cpu"]["ms_per_request"], r["cpu"]
            generate = (f" ({r['batching']['forward_s'] / max(r['ok'], 1) * 1000:.1f})" if "batching" in r else "")
            lines.append(f"| {row['concurrency']} | {name} | {r['rps']} | {ms.get('serve_replica', '-')}{generate} | "
                         f"{ms.get('serve_proxy', '-')} | {ms.get('mlflow_server', '-')} | {ms.get('client', '-')} | "
                         f"{ms.get('ray_other', '-')} | {cpu['ours_cores']} / {cpu['machine_busy_cores']} "
                         f"of {cpu['cores']} |")
    return "\n".join(lines)


def summary(plan: Plan, model: str, floor: dict[str, float], correctness, rows) -> dict[str, Any]:
    systems = [name for name in ("serve", "serve_stream", "mlflow") if name in correctness]
    errors = sum(row[name]["errors"] for row in rows for name in systems)
    errors += sum(c["errors"] for c in correctness.values())
    mismatches = sum(row[name]["mismatches"] for row in rows for name in systems)
    mismatches += sum(c["mismatches"] for c in correctness.values())
    at16 = next((row["rps_ratio"] for row in rows if row["concurrency"] == 16), None)
    import torch

    return {"benchmark": "serve_load", "model": model, "device": plan.device, "dtype": plan.dtype,
            "gpus": plan.gpus, "gpu": torch.cuda.get_device_name(0) if plan.gpus else None,
            "threads": plan.threads, "cpus": os.cpu_count(),
            "ports": {"serve": plan.serve_port, "mlflow": plan.mlflow_port, "registry": plan.registry_port,
                      "direct": plan.direct_port},
            "ingress": "direct" if plan.direct_port else "proxy",
            "max_batch_size": plan.max_batch_size,
            "in_process_ms": floor, "correctness": correctness, "errors": errors,
            "mismatches": mismatches, "rps_ratio": {str(r["concurrency"]): r["rps_ratio"] for r in rows},
            "serve_4x_at_16": None if at16 is None else at16 >= 4, "levels": rows}


# ---------------------------------------------------------------------------------------------- main
def run(plan: Plan) -> dict[str, Any]:
    import torch

    from pipelines.serving.app import load_pyfunc
    from pipelines.serving.loopback import ModelServer
    from pipelines.serving.tiny import needle_questions

    torch.set_num_threads(plan.threads)
    key = secrets.token_urlsafe(32)
    headers = {"Authorization": f"Bearer {key}"}  # Serve's clients; mlflow models serve has no keys
    with ExitStack() as stack:
        model, registry = setup_model(plan, stack)
        served = None
        if plan.mlflow_port is not None:
            served = ModelServer(model, plan.tracking_uri or "", Path(plan.workdir) / "mlflow-serve",
                                 port=plan.mlflow_port, env={"OMP_NUM_THREADS": str(plan.threads),
                                                             "MLFLOW_PYFUNC_INFERENCE_CONFIG":
                                                                 json.dumps(placement_config(plan))})
            stack.callback(served.stop)
        progress(f"serving {model} ({plan.device}, {plan.dtype}); Serve at {serve_url(plan)}"
                 + (" (direct ingress)" if plan.direct_port else "")
                 + (f", mlflow models serve on 127.0.0.1:{plan.mlflow_port}" if served else ""))
        with ThreadPoolExecutor(1) as pool:  # mlflow models serve loads while Ray and Serve start
            starting = pool.submit(served.start) if served else None
            start_serve(plan, model, key, stack)
            # the reference, in this process: the very pyfunc both servers load, placed as they place it
            pyfunc = load_pyfunc(model, plan.tracking_uri, plan.device, plan.dtype)
            if starting:
                starting.result()
        rows, _ = needle_questions(seed=QUESTION_SEED, memories=1)
        chunks, questions = rows[0]["memory"], [r["question"] for r in rows]
        expected = dict(zip(questions, pyfunc.predict(None, rows)))  # the reference: predict over the chunk texts
        store = Path(plan.workdir) / "store"
        pyfunc.write_store(store, chunks, served=True)  # encoded once, for mlflow's rows
        began = time.perf_counter()
        stored = [pyfunc.predict(None, {"question": q, "memory_store": str(store)})[0] for q in questions]
        # the model alone, in this process (servers idle): a predict over the store as mlflow's rows ask it, and the
        # replica's generate at batch 1 and at its largest batch
        floor = {"predict": round((time.perf_counter() - began) / len(questions) * 1000, 2),
                 **{f"generate_batch_{b}": generate_ms(pyfunc, store, questions, b)
                    for b in sorted({1, plan.max_batch_size})}}
        if stored != [expected[q] for q in questions]:
            raise AssertionError(f"the pyfunc answers differently over the store: {stored} "
                                 f"vs {list(expected.values())}")
        import httpx

        created = httpx.post(f"{serve_url(plan)}/v1/memories", json={"chunks": chunks}, timeout=120, headers=headers)
        created.raise_for_status()
        memory = created.json()["id"]
        progress(f"memory {memory[:12]} ({len(chunks)} chunks) created on Serve, store {store} for mlflow; "
                 f"{len(questions)} questions; in this process, ms: {floor}")
        roots = {**({"mlflow_server": served.process.pid} if served else {}),
                 **({"registry": registry.process.pid} if registry else {})}
        systems = {"serve": ServeClient(serve_url(plan), memory, stream=False),
                   "serve_stream": ServeClient(serve_url(plan), memory, stream=True),
                   **({"mlflow": MlflowModelClient(served.url, str(store))} if served else {})}
        correctness, levels = asyncio.run(run_levels(plan, systems, questions, expected, roots, headers))
        return summary(plan, model, floor, correctness, levels)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    plan = make_plan(args)
    if args.dry_run:
        print(f"serve_load plan (dry run, nothing started): workdir {plan.workdir}")
        for c in plan.levels:
            print(f"  level {c:>3} clients: {plan.requests[c]} requests per system (Serve, Serve streamed"
                  f"{'' if plan.mlflow_port is None else ', mlflow'}), "
                  f"at most {plan.time_limit_s:g} s")
        print(f"  ports: Serve {plan.serve_port}" + (f" (clients: direct ingress {plan.direct_port})"
                                                     if plan.direct_port else "")
              + (f", mlflow models serve {plan.mlflow_port}" if plan.mlflow_port else "")
              + (f", mlflow server {plan.registry_port}" if plan.registry_port else ""))
        for name, command in plan.commands.items():
            print(f"  {name}: {command}")
        print(json.dumps({"benchmark": "serve_load", "dry_run": True, **asdict(plan)}))
        return None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its servers
    result = run(plan)
    if not args.workdir:
        shutil.rmtree(plan.workdir, ignore_errors=True)  # kept when the run fails (its servers' logs are there)
    print(table(result["levels"]))
    print()
    print(cpu_table(result["levels"]))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
