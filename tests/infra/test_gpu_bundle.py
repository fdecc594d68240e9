"""`make gpu-check`'s preparation without the network (its --dry-run: which wheels, at which versions, and the device
command printed), the slimming and packing of wheels on small stand-ins, and the GPU box's script's plan: every step
under its limit, the limits inside one 10-minute device command, its Python snippets valid."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import torch

from models.awareness import AwarenessModel
from pipelines.train.hooks import HOOK_ENV
from pipelines.train.profiling import OUT_ENV, STEPS_ENV

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bundle, check = load("gpu_bundle"), load("gpu_check")


def test_the_dry_run_plans_the_locks_versions_and_prints_the_device_command():
    result = subprocess.run([sys.executable, "benchmarks/gpu_bundle.py", "--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PIP_NO_INDEX": "1"})
    assert result.returncode == 0, result.stderr
    versions = bundle.locked_versions()
    for name in ("ray", "deepspeed", "transformers", "peft", "mlflow-skinny", "huggingface-hub", "pydantic"):
        assert f"{name}=={versions[name]}" in result.stdout, name
    assert "deepspeed==0.19.8" in result.stdout and "built here from the sdist" in result.stdout
    assert "torch" not in {line.split("==")[0].strip() for line in result.stdout.splitlines()}  # the box's torch
    assert ('run(command="python3 benchmarks/gpu_check.py --bundle .gpu-bundle --out $OUT", carry=[".gpu-bundle"], '
            'timeout_s=590)') in result.stdout


def test_make_gpu_check_runs_the_bundle_script():
    result = subprocess.run(["make", "-n", "gpu-check", "GPU_BUNDLE=--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert "benchmarks/gpu_bundle.py --dry-run" in result.stdout


def wheel(path: Path, files: dict[str, bytes]) -> Path:
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items())
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("ray-2.60.0.dist-info/RECORD", record)
    return path


def test_ray_loses_its_jar_maps_and_rllib_and_every_wheel_is_stored(tmp_path):
    files = {"ray/__init__.py": b"x = 1\n", "ray/jars/ray_dist.jar": b"j" * 100, "ray/rllib/a.py": b"",
             "ray/dashboard/client/build/static/main.js": b"js", "ray/dashboard/client/build/static/main.js.map": b"m"}
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    slim = bundle.restored(wheel(tmp_path / "in" / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl", files),
                           tmp_path / "out")
    with zipfile.ZipFile(slim) as z:
        names = set(z.namelist())
        record = z.read("ray-2.60.0.dist-info/RECORD").decode()
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}
    assert names == {"ray/__init__.py", "ray/dashboard/client/build/static/main.js", "ray-2.60.0.dist-info/RECORD"}
    assert "jars" not in record and "rllib" not in record and ".map" not in record and "ray/__init__.py" in record


def test_bitsandbytes_keeps_only_the_boxs_cuda_13_and_cpu_libraries(tmp_path):
    libraries = ["cuda118", "cuda121", "cuda128", "cuda130", "cuda132", "rocm64", "rocm715", "xpu2025", "cpu"]
    files = {"bitsandbytes/__init__.py": b"", **{f"bitsandbytes/libbitsandbytes_{lib}.so": b"so" for lib in libraries}}
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    slim = bundle.restored(wheel(tmp_path / "in" / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", files),
                           tmp_path / "out")
    with zipfile.ZipFile(slim) as z:
        kept = {n.removeprefix("bitsandbytes/libbitsandbytes_").removesuffix(".so") for n in z.namelist()
                if n.endswith(".so")}
    assert kept == {"cuda130", "cuda132", "cpu"}


def test_parts_join_back_into_the_wheels(tmp_path):
    (tmp_path / "wheels").mkdir()
    payload = os.urandom(5 << 19)  # 2.5 MiB that xz cannot shrink: 3 parts of at most 1 MiB
    wheels = [tmp_path / "wheels" / "a-1-py3-none-any.whl"]
    wheels[0].write_bytes(payload)
    parts = bundle.pack(wheels, tmp_path, part_mib=1)
    assert [p.name for p in parts] == ["bundle.tar.xz.part000", "bundle.tar.xz.part001", "bundle.tar.xz.part002"]
    assert all(p.stat().st_size <= 1 << 20 for p in parts)
    joined = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(joined), mode="r:xz") as tar:
        assert tar.extractfile("a-1-py3-none-any.whl").read() == payload


def test_the_gpu_box_script_fits_one_device_command():
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", "unused", "--dry-run"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    steps = check.steps(sys.executable)
    default = check.steps_to_run(steps, [])
    assert [s.name for s in default] == ["versions", "gpu tests", "mfu proto1 levers", "mfu scale",
                                         "mfu prod 8 layers"]
    assert sum(s.limit_s for s in default) <= check.BUDGET_S <= 540  # the device's 600 s command, install and report
    second = check.steps_to_run(steps, ["stage2 corpus", "stage2 proto1 50 steps", "mfu proto1 stage shape",
                                        "ttft 16k 64k", "versions"])
    assert sum(s.limit_s for s in second) <= check.BUDGET_S  # the stage job and TTFT: a second device command
    job = next(s for s in check.steps(sys.executable, out=Path("/report")) if s.name == "stage2 proto1 50 steps")
    assert job.env == {HOOK_ENV: "pipelines.train.profiling:profile_steps", STEPS_ENV: "20:25",  # steps 21-25
                       OUT_ENV: "/report/stage2-step-profile.txt"}
    assert (check.HOOK_ENV, check.PROFILE_STEPS_ENV, check.PROFILE_OUT_ENV) == (HOOK_ENV, STEPS_ENV, OUT_ENV)
    serving = check.steps_to_run(steps, ["versions", "serve demo", "serve proto1", "versions"])  # in the order named
    assert [s.name for s in serving] == ["versions", "serve demo", "serve proto1"]
    assert sum(s.limit_s for s in serving) <= check.BUDGET_S  # the serving checks: one device command of their own
    for step in serving[1:]:
        code = step.command[2]
        assert "'--device', 'cuda', '--dtype', 'bfloat16', '--serve-only'" in code and "serve_load.py" in code
    for step in steps:
        if step.command[1] == "-c":
            compile(step.command[2], step.name, "exec")
    only = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", "unused", "--dry-run", "--only",
                           "gpu tests"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert only.returncode == 0 and only.stdout.count(" s  ") == 1 and "gpu tests" in only.stdout, only.stderr
    stage2 = next(s for s in steps if s.name.startswith("stage2 proto1")).command
    for flag, value in (("--deepspeed.precision", "bf16"), ("--deepspeed.zero_stage", "none"),
                        ("--scaling.use_gpu", "true"), ("--train.max_steps", "50"), ("--model.pair", "proto1")):
        assert stage2[stage2.index(flag) + 1] == value, flag


GPU_CHECK_IMPORTS = ["models", "pipelines.corpora.random_rows", "pipelines.train.driver",
                     "pipelines.train.recipes.jobs", "pipelines.evaluate.common", "pipelines.evaluate.efficiency",
                     "gpu_mfu", "serve_load", "pipelines.serving.app",
                     *sorted(f"tests.gpu.{p.stem}" for p in (ROOT / "tests" / "gpu").glob("test_*.py"))]

WHAT_THEY_IMPORT = """
import importlib, importlib.metadata as md, json, sys
sys.path[:0] = [{root!r}, {root!r} + "/benchmarks"]
for name in {modules!r}:
    importlib.import_module(name)
tops = md.packages_distributions()
print(json.dumps(sorted({{d.lower().replace("_", "-") for m in list(sys.modules)
                          for d in tops.get(m.split(".")[0], [])}})))
"""


@pytest.mark.slow  # a process importing every GPU check (a minute here); nightly, and whenever the bundle changes
def test_every_dependency_the_gpu_checks_import_travels_or_is_on_the_box():
    """A project dependency the checks import but the bundle lacks fails every step on the box at import
    (fastokens did, on an H200): each is in BUNDLE, or in BOX_PROVIDES, or ships the same module as one in BUNDLE
    (mlflow's client, as mlflow-skinny)."""
    script = WHAT_THEY_IMPORT.format(root=str(ROOT), modules=GPU_CHECK_IMPORTS)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    imported = set(json.loads(result.stdout.splitlines()[-1]))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    dependencies = {re.split(r"[<>=!~\[ ;]", d)[0].lower() for d in project}
    shipped_with = {d.lower(): {m for m, ds in packages_distributions().items() if d in ds} for d in bundle.BUNDLE}
    bundled_modules = set().union(*shipped_with.values())
    modules_of = {d.lower().replace("_", "-"): m for m, ds in packages_distributions().items() for d in ds}
    missing = [d for d in sorted(imported & dependencies)
               if d not in bundle.BUNDLE and d not in bundle.BOX_PROVIDES and modules_of.get(d) not in bundled_modules]
    assert imported & dependencies >= {"torch", "transformers", "fastokens"}  # the probe saw the imports
    assert not missing, f"the GPU checks import {missing}: add them to benchmarks/gpu_bundle.py's BUNDLE"


def test_a_trained_export_travels_with_its_base_checkpoints(tmp_path, checkpoint_root):
    """`gpu_bundle.py --export`: the export and the two checkpoints its config names, side by side, so the box's
    "serve demo" step can point the config at them."""
    from pipelines.serving.tiny import tiny_export

    shutil.copytree(checkpoint_root, tmp_path / "base")
    trained = tiny_export(tmp_path / "trained", tmp_path / "base")
    planned = subprocess.run([sys.executable, "benchmarks/gpu_bundle.py", "--dry-run", "--export",
                              str(tmp_path / "trained")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0 and f"and the export {tmp_path / 'trained'} with its base checkpoints" in (
        planned.stdout), planned.stderr
    wrong = subprocess.run([sys.executable, "benchmarks/gpu_bundle.py", "--dry-run", "--export", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "no awareness_config.json there" in wrong.stderr
    copied = bundle.bundle_export(tmp_path / "trained", tmp_path / "bundle" / "export")
    names = {f.relative_to(tmp_path / "bundle" / "export").as_posix() for f in copied}
    assert {"export/awareness_config.json", "export/awareness.safetensors", "decoder/config.json",
            "decoder/model.safetensors", "encoder/model.safetensors"} <= names
    # the bundle lands elsewhere on the box, without the checkpoints it was made from: it loads the same model
    landed = tmp_path / "box" / "bundle"
    shutil.move(tmp_path / "bundle" / "export", landed)
    shutil.rmtree(tmp_path / "base")
    travelled = AwarenessModel.from_pretrained(landed / "export").eval()
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    memory = torch.randint(3, 100, (1, 2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = (m(input_ids=ids, memory_input_ids=memory, memory_attention_mask=torch.ones_like(memory)).logits
                     for m in (trained, travelled))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
