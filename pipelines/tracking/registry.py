"""The MLflow model registry: a training run's exported artifact becomes a version of a registered model, with its
lineage as version tags and the alias `candidate`; promotion moves the alias `production`."""

from __future__ import annotations

import json
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
import pyarrow.fs
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from models import AwarenessConfig
from pipelines.data.tokenizer import EOS
from pipelines.tracking.checkpoints import RECORDS, exists, open_uri, record_name
from pipelines.tracking.pyfunc import ensure_tokenizer, signature
from pipelines.tracking.tracker import resolve_tracking_uri

DEFAULT_NAME = "awareness"
MODEL_DESCRIPTION = "Qwen3 decoders reading an encoder memory through GCA"
MODEL_ARTIFACT = "pyfunc"  # where the pyfunc model is logged inside the run
LINEAGE_TAGS = ("pair", "stage", "base.decoder", "base.encoder", "data.manifest_hash", "git.commit")
# The model's own code travels with it (MLflow `code_paths`, put on sys.path at load): a serving machine needs the
# pip requirements and the base checkpoints, not this repository.
CODE_PATHS = tuple(str(Path(__file__).resolve().parents[2] / package) for package in ("models", "pipelines"))


def register_run(run_id: str, *, tracking_uri: str | None = None, name: str = DEFAULT_NAME, alias: str = "candidate",
                 sweep_run_id: str | None = None, max_new_tokens: int | None = None, step: int | None = None):
    """Logs the run's `export/` artifact (or, with `step`, the export inside that step's checkpoint, found through
    the run's checkpoint record) as a pyfunc model into that run and registers it. Returns the ModelVersion. The
    model references the base checkpoints the export names; they must exist where it is loaded."""
    uri = resolve_tracking_uri(tracking_uri)
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    artifact, checkpoint_tags = MODEL_ARTIFACT, {}
    with tempfile.TemporaryDirectory() as tmp:
        if step is None:
            export = Path(_download_export(client, run_id, tmp))
        else:
            record = checkpoint_record(client, run_id, step, tmp)
            export = _copy_export(record, Path(tmp) / "checkpoint-export")
            artifact = f"{MODEL_ARTIFACT}/step_{step}"
            checkpoint_tags = {"checkpoint.step": str(step), "checkpoint.uri": record["uri"]}
        config = AwarenessConfig.load(export)
        ensure_tokenizer(config.decoder)
        settings = {"max_new_tokens": max_new_tokens or _answer_length(run.data.params), **_answer_end(run.data.params)}
        log_pyfunc(client, run_id, Path(__file__).with_name("pyfunc_entry.py"), {"export": str(export)}, signature(),
                   settings, _requirements(), artifact)
    tags = lineage_tags(run, config, sweep_run_id) | checkpoint_tags
    at = f", checkpoint of step {step}: {checkpoint_tags['checkpoint.uri']}" if step is not None else ""
    return register_version(client, name, run, artifact, tags, f"run {run.info.run_name} ({run_id}){at}", alias)


def log_pyfunc(client, run_id: str, entry: Path, artifacts: dict[str, str], signature, model_config: dict[str, Any],
               requirements: list[str], artifact: str = MODEL_ARTIFACT) -> str:
    """A pyfunc model from code (`entry` calls mlflow.models.set_model; nothing pickled) with its artifacts, our
    code (CODE_PATHS) and stated requirements, logged into the run at `artifact`; returns its runs:/ URI."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / MODEL_ARTIFACT
        mlflow.pyfunc.save_model(str(model_dir), python_model=str(entry), artifacts=artifacts, signature=signature,
                                 model_config=model_config, pip_requirements=requirements, code_paths=list(CODE_PATHS))
        client.log_artifacts(run_id, str(model_dir), artifact)
    return f"runs:/{run_id}/{artifact}"


def register_version(client, name: str, run, artifact: str, tags: dict[str, str], description: str,
                     alias: str = "candidate", model_description: str = ""):
    """A new version of registered model `name` from the run's logged pyfunc at `artifact`, `alias` pointed at it."""
    _ensure_registered_model(client, name, model_description or MODEL_DESCRIPTION)
    version = client.create_model_version(name, source=f"{run.info.artifact_uri}/{artifact}", run_id=run.info.run_id,
                                          tags=tags, description=description)
    client.set_registered_model_alias(name, alias, version.version)
    return version


def promote(version: str | int, *, tracking_uri: str | None = None, name: str = DEFAULT_NAME,
            alias: str = "production"):
    """Points `alias` (production) at `version`; the version it pointed at before keeps its other aliases."""
    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    found = client.get_model_version(name, str(version))  # raises with MLflow's message when it does not exist
    client.set_registered_model_alias(name, alias, found.version)
    return found


def lineage_tags(run, config, sweep_run_id: str | None) -> dict[str, str]:
    tags = {k: run.data.tags[k] for k in LINEAGE_TAGS if k in run.data.tags}
    tags |= {"run_id": run.info.run_id, "base.decoder": config.decoder, "base.encoder": config.encoder,
             "gca_layers": ",".join(map(str, config.gca_layers)), "fusion": config.fusion}
    sweep = sweep_run_id or run.data.tags.get("sweep.run_id") or run.data.tags.get("mlflow.parentRunId")
    if sweep:
        tags["sweep_run_id"] = sweep
    return tags


def checkpoint_record(client, run_id: str, step: int, directory: str) -> dict[str, Any]:
    """The run's record of its checkpoint at `step` (pipelines.tracking.checkpoints), checked to still hold an
    export; the errors say which steps there are and why one cannot be registered."""
    try:
        path = client.download_artifacts(run_id, record_name(step), directory)
    except (MlflowException, OSError):
        steps = sorted(int(a.path.rsplit("_", 1)[1].split(".")[0]) for a in client.list_artifacts(run_id, RECORDS))
        raise FileNotFoundError(f"MLflow run {run_id} recorded no checkpoint at step {step}; its checkpoints: "
                                f"steps {steps or 'none'}") from None
    record = json.loads(Path(path).read_text())
    if not exists(record["uri"]):
        raise FileNotFoundError(f"the checkpoint of step {step} ({record['uri']}) no longer exists: Ray Train keeps "
                                f"only the last run.keep_checkpoints; keep more with --run.keep_checkpoints N")
    if not record.get("export"):
        raise FileNotFoundError(f"the checkpoint of step {step} ({record['uri']}) holds no export/: it was written "
                                f"with run.export_every_checkpoint false; register the run's final export (no --step)")
    return record


def _copy_export(record: dict[str, Any], destination: Path) -> Path:
    """A checkpoint's export/ from the storage path (local, NFS, or a bucket through pyarrow) to a local directory."""
    fs, path = open_uri(record["export"])
    destination.mkdir(parents=True, exist_ok=True)
    pyarrow.fs.copy_files(path, str(destination), source_filesystem=fs,
                          destination_filesystem=pyarrow.fs.LocalFileSystem())
    return destination


def _download_export(client, run_id: str, directory: str) -> str:
    names = {a.path for a in client.list_artifacts(run_id)}
    if "export" not in names:
        raise FileNotFoundError(
            f"MLflow run {run_id} has no 'export' artifact (it has {sorted(names)}): register a run that trained to "
            f"its last step (a stage job's run, or a sweep trial that was not stopped early)"
        )
    return client.download_artifacts(run_id, "export", directory)


def _answer_length(params: dict[str, str]) -> int:
    """Needle runs answer value_digits + EOS; otherwise a generic default."""
    digits, corpus = params.get("needle.value_digits"), params.get("data.train_path", "None")
    return int(digits) + 1 if digits and corpus in ("None", "") else 32


def _answer_end(params: dict[str, str]) -> dict[str, Any]:
    """How answers end and read: corpus rows end every target with <|im_end|> and may answer in agentic tokens
    (<plan>, <read>, <edit>), kept in the text; needles end with <eos>; a real pair's own checkpoint decides."""
    if params.get("data.train_path", "None") not in ("None", ""):
        return {"eos_token": EOS, "skip_special_tokens": False}
    return {"eos_token": "<eos>" if params.get("model.pair", "").startswith(("tiny", "small")) else None}


def _ensure_registered_model(client, name: str, description: str) -> None:
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=description)


def _requirements() -> list[str]:
    """Stated, not inferred (inference imports and times every module): what the model's code imports at load."""
    return pinned_requirements("torch", "transformers", "tokenizers", "peft", "safetensors", "numpy",
                               "bm25s")  # bm25s: a rag baseline's retrieval


def pinned_requirements(*packages: str) -> list[str]:
    """Each package pinned to the version installed here (torch without its local build tag, e.g. +cpu)."""
    return [f"{p}=={version(p).split('+')[0]}" for p in packages]


def describe(version) -> dict[str, Any]:
    return {"name": version.name, "version": version.version, "run_id": version.run_id, "tags": dict(version.tags),
            "aliases": list(getattr(version, "aliases", []) or [])}
