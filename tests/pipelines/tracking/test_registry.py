"""The registry's pieces that need no server (pipelines/tracking/registry.py): a version's lineage tags from its run
and export config, a checkpoint record's three refusals with the fix, and pinned requirements. Registering against a
real `mlflow server`: tests/pipelines/serving/test_register.py and tests/pipelines/tracking/test_checkpoints.py."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException

from pipelines.tracking.checkpoints import record_name
from pipelines.tracking.registry import checkpoint_record, describe, lineage_tags, pinned_requirements

CONFIG = SimpleNamespace(decoder="/ckpt/Qwen3-8B", encoder="/ckpt/Qwen3-Embedding-0.6B", gca_layers=[24, 30, 35],
                         fusion="gca")


def run_with(tags: dict[str, str]):
    return SimpleNamespace(info=SimpleNamespace(run_id="r1"), data=SimpleNamespace(tags=tags))


def test_lineage_tags_keep_the_runs_lineage_and_name_the_export():
    run = run_with({"pair": "prod", "stage": "2", "git.commit": "abc", "data.manifest_hash": "f00",
                    "base.decoder": "stale", "sys.torch": "2.13", "mlflow.parentRunId": "parent"})
    tags = lineage_tags(run, CONFIG, None)
    assert tags == {"pair": "prod", "stage": "2", "git.commit": "abc", "data.manifest_hash": "f00", "run_id": "r1",
                    "base.decoder": "/ckpt/Qwen3-8B", "base.encoder": "/ckpt/Qwen3-Embedding-0.6B",
                    "gca_layers": "24,30,35", "fusion": "gca", "sweep_run_id": "parent"}  # the export's config wins
    assert lineage_tags(run_with({"sweep.run_id": "s", "mlflow.parentRunId": "p"}), CONFIG, None)["sweep_run_id"] == "s"
    assert lineage_tags(run_with({"sweep.run_id": "s"}), CONFIG, "given")["sweep_run_id"] == "given"
    assert "sweep_run_id" not in lineage_tags(run_with({}), CONFIG, None)


class Client:
    """MlflowClient's two calls checkpoint_record makes, over a hand-written run: records by step."""

    def __init__(self, records: dict[int, dict], root: Path):
        self.records, self.root = records, root

    def download_artifacts(self, run_id, path, directory):
        step = next((s for s in self.records if record_name(s) == path), None)
        if step is None:
            raise MlflowException(f"no artifact {path}")
        out = Path(directory) / Path(path).name
        out.write_text(json.dumps(self.records[step]))
        return str(out)

    def list_artifacts(self, run_id, path):
        return [SimpleNamespace(path=record_name(s)) for s in self.records]


def test_a_checkpoint_record_is_refused_with_the_reason_and_the_fix(tmp_path):
    kept = tmp_path / "checkpoint_000002"
    kept.mkdir()
    client = Client({2: {"uri": str(kept), "export": f"{kept}/export"},
                     4: {"uri": str(tmp_path / "checkpoint_000004"), "export": "x"},  # deleted by Ray Train
                     6: {"uri": str(kept), "export": None}}, tmp_path)  # written without its export
    assert checkpoint_record(client, "r1", 2, str(tmp_path))["uri"] == str(kept)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 3; its checkpoints: steps \[2, 4, 6\]"):
        checkpoint_record(client, "r1", 3, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no longer exists.*--run.keep_checkpoints N"):
        checkpoint_record(client, "r1", 4, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"holds no export/.*register the run's final export \(no --step\)"):
        checkpoint_record(client, "r1", 6, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="steps none"):
        checkpoint_record(Client({}, tmp_path), "r1", 1, str(tmp_path))


def test_requirements_are_pinned_to_what_is_installed_without_local_tags():
    torch_pin, numpy_pin = pinned_requirements("torch", "numpy")
    assert torch_pin == f"torch=={version('torch').split('+')[0]}" and "+" not in torch_pin
    assert numpy_pin == f"numpy=={version('numpy')}"
    found = SimpleNamespace(name="awareness", version="3", run_id="r1", tags={"pair": "tiny"}, aliases=["candidate"])
    assert describe(found) == {"name": "awareness", "version": "3", "run_id": "r1", "tags": {"pair": "tiny"},
                               "aliases": ["candidate"]}
