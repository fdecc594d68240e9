"""The MLflow model registry: a training run's exported artifact becomes a version of a registered model, with its
lineage as version tags and the alias `candidate`; promotion moves the alias `production`."""

from __future__ import annotations

import json
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.tracking import MlflowClient
from mlflow.types.schema import ColSpec, DataType, Schema

from pipelines.tracking.checkpoints import RECORDS, exists, record_name
from pipelines.tracking.tracker import Tracker, resolve_tracking_uri

DEFAULT_NAME = "awareness"
MODEL_DESCRIPTION = "Qwen3 decoders reading an encoder memory through GCA"
MODEL_ARTIFACT = "pyfunc"  # where the pyfunc model is logged inside the run
LINEAGE_TAGS = ("pair", "stage", "base.decoder", "base.encoder", "data.manifest_hash", "git.commit")
# The model's own code travels with it (MLflow `code_paths`, put on sys.path at load): a serving machine needs the
# pip requirements and the base checkpoints, not this repository.
CODE_PATHS = tuple(str(Path(__file__).resolve().parents[2] / package) for package in ("models", "pipelines"))

# The traffic VLM's pyfunc (pipelines/serving/traffic_pyfunc.py), logged from its entry file at the end of its job.
TRAFFIC_ENTRY = Path(__file__).resolve().parents[1] / "serving" / "traffic_pyfunc_entry.py"
TRAFFIC_REQUIREMENTS = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pillow")


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






def _ensure_registered_model(client, name: str, description: str) -> None:
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=description)



def pinned_requirements(*packages: str) -> list[str]:
    """Each package pinned to the version installed here (torch without its local build tag, e.g. +cpu)."""
    return [f"{p}=={version(p).split('+')[0]}" for p in packages]


def describe(version) -> dict[str, Any]:
    return {"name": version.name, "version": version.version, "run_id": version.run_id, "tags": dict(version.tags),
            "aliases": list(getattr(version, "aliases", []) or [])}


def traffic_signature() -> ModelSignature:
    return ModelSignature(inputs=Schema([ColSpec(DataType.binary, "image"), ColSpec(DataType.string, "question")]),
                          outputs=Schema([ColSpec(DataType.string)]))


def log_traffic_pyfunc(tracker: Tracker, export_dir: str, registered_model: str | None) -> dict[str, Any]:
    """Logs the export as a pyfunc into the tracker's run (and registers it as `registered_model`@candidate);
    returns the summary's fields. A tracking failure is reported there, not raised: the model is trained and
    exported either way."""
    if tracker.client is None:
        return {"pyfunc": None}
    try:
        uri = log_pyfunc(tracker.client, tracker.run_id, TRAFFIC_ENTRY, {"export": str(export_dir)},
                         traffic_signature(), {}, pinned_requirements(*TRAFFIC_REQUIREMENTS), MODEL_ARTIFACT)
        if not registered_model:
            return {"pyfunc": uri, "registered": None}
        run = tracker.client.get_run(tracker.run_id)
        tags = {k: v for k, v in run.data.tags.items() if k in ("job", "data.manifest_hash", "git.commit")}
        version = register_version(tracker.client, registered_model, run, MODEL_ARTIFACT,
                                   tags | {"run_id": tracker.run_id},
                                   f"run {run.info.run_name} ({tracker.run_id})",
                                   model_description="Traffic-scene VLM: PNG + question -> yes / no")
        return {"pyfunc": uri, "registered": f"models:/{registered_model}/{version.version}"}
    except Exception as error:  # noqa: BLE001 - reported in the summary line, the export stays on disk
        return {"pyfunc": None, "pyfunc_error": f"{type(error).__name__}: {error}"[:300]}
