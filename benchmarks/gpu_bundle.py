"""What a GPU box lacks, as wheels for its Python, in parts that travel with the working tree (`make gpu-check`).

    python benchmarks/gpu_bundle.py             # download, slim, pack .gpu-bundle/ and print the command to run there
    python benchmarks/gpu_bundle.py --dry-run   # the plan: wheels, versions, the command; no network, nothing written

The box (docs/testing.md, GPU checks) has Python 3.12, a CUDA torch, numpy, pandas, pyarrow and most small libraries,
an older transformers, and no Ray, DeepSpeed or MLflow, and no network. BUNDLE names what the GPU checks import
that it lacks (or holds at a version this project cannot use), each at the lock's version (requirements.txt):
manylinux wheels from PyPI for the target Python, and DeepSpeed (an sdist on PyPI) built here into a pure-Python
wheel with no ops compiled (it JIT-builds what it needs there). Ray's wheel (79 MB) loses its Java jar (31 MB
compressed), the dashboard's source maps and RLlib, which nothing here runs. The wheels are re-zipped uncompressed
and the lot packed as one xz stream, split into parts of at most --part-mib; a device call carries at most 64 MiB of
working tree, this repository's own files included, so the command printed says whether the parts fit in one call.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.txt"
OUT = ROOT / ".gpu-bundle"
CALL_LIMIT_MIB = 64  # the working tree a device call carries, bundle included
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64")
# What the GPU checks import (tests/gpu, gpu_mfu.py, a stage job through Ray Train, the efficiency suite) that the
# box lacks, read off `sys.modules` after importing them, against the box's package list (KINDS.md, 2026-11-17).
BUNDLE = {
    "ray": "Ray Train and Data (pipelines.train imports ray.train)",
    "deepspeed": "ZeRO-3 and bf16 (built here from its sdist, no ops compiled)",
    "transformers": "the box's 5.17 predates the `cache` argument (5.24) the models use",
    "huggingface-hub": "transformers 5.24's",
    "peft": "LoRA, at the lock's version",
    "mlflow-skinny": "MLflow's client (pipelines.tracking imports it; the checks run with tracking off)",
    "mlflow-tracing": "mlflow-skinny's",
    "databricks-sdk": "mlflow-skinny's", "sqlparse": "mlflow-skinny's", "cachetools": "mlflow-skinny's",
    "importlib-metadata": "mlflow-skinny's", "fastapi": "mlflow-skinny's", "starlette": "fastapi's",
    "opentelemetry-api": "mlflow-tracing's", "opentelemetry-sdk": "mlflow-tracing's",
    "opentelemetry-proto": "mlflow-tracing's", "opentelemetry-semantic-conventions": "opentelemetry-sdk's",
    "opentelemetry-exporter-prometheus": "ray's metrics", "google-auth": "databricks-sdk's",
    "google-api-core": "ray's", "googleapis-common-protos": "ray's", "pyasn1": "google-auth's",
    "pyasn1-modules": "google-auth's", "colorful": "ray's", "httpx2": "the pipeline's", "httpcore2": "httpx2's",
    "truststore": "httpx2's", "wcwidth": "the console", "pydantic": "DeepSpeed's and Ray's config",
    "pydantic-core": "pydantic's", "annotated-types": "pydantic's", "typing-inspection": "pydantic's",
    "hjson": "DeepSpeed's", "jsonschema": "ray's", "jsonschema-specifications": "jsonschema's",
    "referencing": "jsonschema's", "rpds-py": "referencing's", "bm25s": "the rag baseline (imported by the suites)",
    "fastokens": "the offline tokenizer (pipelines.format.tokenizer imports it)",
    # the serving steps (gpu_check.py --only "serve demo"): what Ray Serve's proxy, controller and replica imported,
    # read off each process's sys.modules during a serve_load run here, less what the box has
    "uvicorn": "Ray Serve's HTTP proxy", "httptools": "uvicorn's HTTP parser", "websockets": "uvicorn's",
    "watchfiles": "ray.serve's", "grpcio-reflection": "Ray Serve's gRPC proxy (imported at start)",
    "grpcio": "grpcio-reflection's generated code refuses the box's 1.84 (H100, 2026-11-26)",
    "protobuf": "at the version the lock's grpcio and Ray are used with here",
    "tree-sitter": "the app's repository chunker (pipelines.corpora.syntax)",
    "bitsandbytes": "QLoRA's 4- and 8-bit base weights and 8-bit Adam (models/quantization.py)",
    "dashscope": "Qwen's BPE ranks for a random-weight Qwen3-vocabulary pair's tokenizer (found, not imported: the "
                 "proto1 serving step stopped on it, H100, 2026-11-26)",
}
# This project's dependencies that the GPU checks import and the box already holds at a usable version: the box's
# own torch is the point, the rest are its image's (KINDS.md). tests/infra/test_gpu_bundle.py holds every project
# dependency the checks import to BUNDLE or here (fastokens, in neither, stopped the first run on an H200).
BOX_PROVIDES = {"torch", "numpy", "packaging", "psutil", "pyarrow", "pyyaml", "safetensors", "tiktoken", "tokenizers",
                "tqdm", "markdown-it-py", "httpx"}
SDIST_ONLY = {"deepspeed"}
RAY_DROPPED = (re.compile(r"^ray/jars/"), re.compile(r"^ray/dashboard/client/build/.*\.map$"),
               re.compile(r"^ray/rllib/"))
# bitsandbytes ships one native library per CUDA, ROCm and XPU release (129 MiB); the box's torch is CUDA 13, whose
# library bitsandbytes loads by torch.version.cuda (KINDS.md), so the others stay here
BNB_DROPPED = (re.compile(r"^bitsandbytes/libbitsandbytes_(cuda1[0-2]\d|rocm\d+|xpu\d+)\.so$"),)
DROPPED = {"ray-": RAY_DROPPED, "bitsandbytes-": BNB_DROPPED}


def locked_versions(lock: Path = LOCK) -> dict[str, str]:
    """name -> version of every `name==version` line of the lock."""
    return {m[1].lower(): m[2] for m in re.finditer(r"^([A-Za-z0-9_.\-]+)==([^ \\\n]+)", lock.read_text(), re.M)}


# CUDA-only dependencies (pyproject's `cuda` extra): at the CUDA lock's versions; the box has Triton
CUDA_BUNDLE = {
    "liger-kernel": "fused RMSNorm, SwiGLU, RoPE and linear cross-entropy (models/kernels.py, models/loss.py)",
}
CUDA_LOCK = ROOT / "requirements-cuda.txt"


def plan(python: str) -> list[str]:
    """`name==version` for each wheel of the bundle, at the lock's versions."""
    cuda = locked_versions(CUDA_LOCK)
    missing = sorted(n for n in CUDA_BUNDLE if n not in cuda)
    if missing:
        raise SystemExit(f"{CUDA_LOCK.name} pins none of {missing}: run make lock")
    return _cpu_lock_plan() + [f"{name}=={cuda[name]}" for name in sorted(CUDA_BUNDLE)]


def _cpu_lock_plan() -> list[str]:
    versions = locked_versions()
    missing = sorted(n for n in BUNDLE if n not in versions)
    if missing:
        raise SystemExit(f"{LOCK.name} pins none of {missing}: update BUNDLE")
    return [f"{name}=={versions[name]}" for name in sorted(BUNDLE)]


def download(requirements: list[str], python: str, into: Path) -> None:
    binary = [r for r in requirements if r.split("==")[0] not in SDIST_ONLY]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "-d", str(into), *binary],
                   check=True)
    for requirement in requirements:
        if requirement.split("==")[0] in SDIST_ONLY:  # pure Python once built: any Python 3 takes the wheel
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(into), requirement], check=True, env={**_env(), "DS_BUILD_OPS": "0"})


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def restored(wheel: Path, into: Path) -> Path:
    """The wheel re-zipped without compression (xz compresses the whole bundle far better), Ray's and bitsandbytes'
    without what nothing there runs (DROPPED); RECORD loses the dropped files' lines."""
    target = into / wheel.name
    dropped = next((patterns for prefix, patterns in DROPPED.items() if wheel.name.startswith(prefix)), ())
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        for info in source.infolist():
            if any(p.match(info.filename) for p in dropped):
                continue
            data = source.read(info.filename)
            if dropped and info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                kept = [line for line in lines if not any(p.match(line.split(",")[0]) for p in dropped)]
                data = ("\n".join(kept) + "\n").encode()
            info.compress_type = zipfile.ZIP_STORED
            out.writestr(info, data)
    return target


def pack(wheels: list[Path], out: Path, part_mib: int) -> list[Path]:
    """One tar.xz of the wheels, split into parts of at most part_mib MiB (bundle.tar.xz.part000, ...)."""
    for old in out.glob("bundle.tar.xz.part*"):
        old.unlink()
    archive = out / "bundle.tar.xz"
    subprocess.run(["tar", "-cf", str(archive), "--use-compress-program", "xz -9 -T0", "-C", str(wheels[0].parent),
                    *[w.name for w in wheels]], check=True)
    parts, size = [], part_mib << 20
    with archive.open("rb") as f:
        while chunk := f.read(size):
            part = out / f"bundle.tar.xz.part{len(parts):03d}"
            part.write_bytes(chunk)
            parts.append(part)
    archive.unlink()
    return parts


def bundle_export(export: Path, into: Path) -> list[Path]:
    """The export (export/) and the base checkpoints its config names (decoder/, encoder/) copied into `into`, the
    copy's config naming them by relative paths (read relative to the export), so it loads wherever the bundle lands;
    the files copied."""
    import json

    from models.awareness import CONFIG_NAME

    export = export.resolve()
    config = json.loads((export / CONFIG_NAME).read_text())
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(export, into / "export")
    for name in ("decoder", "encoder"):
        source = Path(config[name]).expanduser()
        shutil.copytree(source if source.is_absolute() else export / source, into / name)
        config[name] = f"../{name}"
    (into / "export" / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return [f for f in into.rglob("*") if f.is_file()]


def travelling_mib() -> float:
    """What a device call carries besides the bundle: tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file()) / 2**20


def command(parts: list[Path], out: Path) -> str:
    """The one device call that runs every GPU check (benchmarks/gpu_check.py)."""
    carry = str(out.relative_to(ROOT)) if out.is_relative_to(ROOT) else str(out)
    return (f'run(command="python3 benchmarks/gpu_check.py --bundle {carry} --out $OUT", carry=["{carry}"], '
            f'timeout_s=590)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default="3.12", help="the GPU box's Python (3.12 on this workplace's boxes)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the parts go (ignored by git)")
    parser.add_argument("--part-mib", type=int, default=60, help="the largest part, in MiB")
    parser.add_argument("--export", type=Path, default=None,
                        help="a trained export (e.g. make demo's) to serve there, with the base checkpoints it names")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the command; no network")
    args = parser.parse_args()
    if args.export and not (args.export / "awareness_config.json").is_file():
        parser.error(f"--export {args.export}: no awareness_config.json there (give an export directory, e.g. a "
                     f"checkpoint's export/)")
    requirements = plan(args.python)
    out = args.out.resolve()
    print(f"bundle for CPython {args.python}, manylinux x86_64, at {LOCK.name}'s versions "
          f"({len(requirements)} wheels):")
    for requirement in requirements:
        name = requirement.split("==")[0]
        how = "built here from the sdist" if name in SDIST_ONLY else "PyPI wheel"
        print(f"  {requirement:<44} {how}: {BUNDLE.get(name) or CUDA_BUNDLE[name]}")
    if args.export:
        print(f"  and the export {args.export} with its base checkpoints, as {out}/export/")
    if args.dry_run:
        print(f"(dry run) would write {out}/bundle.tar.xz.part000..., parts of at most {args.part_mib} MiB")
        print(f"run there, in one device call:\n  {command([], out)}")
        return
    download_dir = out / "download"
    download_dir.mkdir(parents=True, exist_ok=True)
    download(requirements, args.python, download_dir)
    with tempfile.TemporaryDirectory() as staging:
        wheels = [restored(w, Path(staging)) for w in sorted(download_dir.glob("*.whl"))]
        downloaded = sum(w.stat().st_size for w in download_dir.glob("*.whl")) / 2**20
        parts = pack(wheels, out, args.part_mib)
    shutil.rmtree(download_dir)
    exported = bundle_export(args.export, out / "export") if args.export else []
    total = sum(p.stat().st_size for p in parts + exported) / 2**20
    tree = travelling_mib()
    print(f"wheels as downloaded: {downloaded:.1f} MiB; bundle: {total:.1f} MiB in {len(parts)} part(s)")
    for part in parts:
        shown = part.relative_to(ROOT) if part.is_relative_to(ROOT) else part
        print(f"  {shown}: {part.stat().st_size / 2**20:.1f} MiB")
    if exported:
        size = sum(f.stat().st_size for f in exported) / 2**20
        print(f"  {out / 'export'}: {size:.1f} MiB (the export, its checkpoints)")
    fits = total + tree <= CALL_LIMIT_MIB
    print(f"a device call carries the bundle and {tree:.1f} MiB of working tree: {total + tree:.1f} of "
          f"{CALL_LIMIT_MIB} MiB, {'fits in one call' if fits else 'does NOT fit in one call'}")
    print(f"run there, in one device call:\n  {command(parts, out)}")


if __name__ == "__main__":
    main()
