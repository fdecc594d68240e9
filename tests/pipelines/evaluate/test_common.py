"""What every evaluation suite shares (pipelines/evaluate/common.py), without MLflow or a model: a `--model` that is
an export directory resolves to it and its system.json, anything else is refused with what to pass; systems are
labelled by name or memory mode, each label once; the needle task comes from system.json; rows become columns."""

from __future__ import annotations

import json

import pytest

from models.awareness import CONFIG_NAME
from pipelines.data.synthetic_needles import NeedleSpec
from pipelines.evaluate.common import Source, batch_columns, name_sources, needle_spec, resolve_model


def test_an_export_directory_resolves_to_itself_and_its_system(tmp_path):
    export = tmp_path / "run" / "export"
    export.mkdir(parents=True)
    (export / CONFIG_NAME).write_text("{}")
    source = resolve_model(str(export), "sqlite:///unused.db", tmp_path)
    assert source.export == str(export.resolve())
    assert source.system == {"memory": "gca", "needle": None}  # no system.json: an export from before the baselines
    assert source.run_id is None and source.registered is None and source.served is None
    (export / "system.json").write_text(json.dumps({"memory": "rag", "rag_k": 3, "needle": None}))
    assert resolve_model(str(export), "", tmp_path).system["memory"] == "rag"


def test_anything_else_is_refused_with_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not an export \(no awareness_config.json\).*summary line"):
        resolve_model(str(tmp_path), "", tmp_path)
    for reference in ("no/such/dir", "abc123", "0" * 31):  # neither a directory, a 32-hex run id nor models:/
        with pytest.raises(FileNotFoundError, match="not an export directory, a run id .* or a models:/NAME@ALIAS"):
            resolve_model(reference, "", tmp_path)


def sources(*memories: str) -> list[Source]:
    return [Source("", f"/exports/{i}", {"memory": m}) for i, m in enumerate(memories)]


def test_systems_are_labelled_by_name_or_mode_each_label_once():
    named = sources("gca", "gca")
    name_sources(named, ["base", "tuned"])
    assert [s.name for s in named] == ["base", "tuned"]
    by_mode = sources("gca", "rag", "gca", "none")
    name_sources(by_mode, None)
    labels = [s.name for s in by_mode]
    assert labels[1] == "rag" and labels[3] == "none"
    assert len(set(labels)) == 4 and labels[0].startswith("gca") and labels[2] == "gca_2"
    unlabelled = [Source("", "/e", {})]
    name_sources(unlabelled, None)
    assert unlabelled[0].name == "gca"  # an export from before the baselines


def test_two_systems_of_one_mode_are_labelled_as_documented():
    twins = sources("gca", "gca")
    name_sources(twins, None)
    assert [s.name for s in twins] == ["gca_1", "gca_2"]


def test_the_needle_task_comes_from_system_json():
    assert needle_spec({"memory": "gca", "needle": None}) == NeedleSpec()  # a corpus-trained system: the default
    assert needle_spec({}) == NeedleSpec()
    spec = needle_spec({"needle": {"facts": 4, "questions": 2, "chunk_len": 16, "seed": 3, "val_memories": 8}})
    assert spec == NeedleSpec(facts=4, questions=2, chunk_len=16)  # NeedleConfig's other fields are not the task's


def test_rows_become_the_columns_of_a_batch():
    rows = [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    assert batch_columns(rows) == {"a": [1, 2], "b": ["x", "y"]}
    assert batch_columns([]) == {}
