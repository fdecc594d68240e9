"""The training jobs' entry sides (pipelines/train/recipes/jobs.py), light to import and without Ray: each typed config
maps to its job, which names itself, checks its shards, resolves its paths, prints its --dry-run plan and names its
recipe. The jobs end to end: tests/jobs/test_documented_commands.py (every documented command, --dry-run included)
and the stage tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from models.pairs import default_tiny_root
from pipelines.train.configs.retriever import RetrieverConfig
from pipelines.train.configs.stage import StageConfig
from pipelines.train.configs.stage4 import Stage4Config
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.configs.ul2 import Ul2Config
from pipelines.train.presets import ENCODER_UL2, RETRIEVER, STAGE0, STAGE4, TRAFFIC_VLM
from pipelines.train.recipes.jobs import JOBS, RetrieverJob, Stage4Job, StageJob, TrafficJob, Ul2Job, job_for
from tests.pipelines.format.test_shards import token_rows, write_split


def test_each_config_type_has_its_job_and_name():
    assert set(JOBS) == {StageConfig, Stage4Config, Ul2Config, TrafficConfig, RetrieverConfig}
    presets = (STAGE0, STAGE4, ENCODER_UL2, TRAFFIC_VLM, RETRIEVER)
    assert [type(job_for(c)) for c in presets] == [StageJob, Stage4Job, Ul2Job, TrafficJob, RetrieverJob]
    assert [job_for(c).name(c) for c in presets] == ["stage0", "stage4", "encoder_ul2", "traffic_vlm", "retriever"]
    stage2 = dataclasses.replace(STAGE0, stage=2)
    assert job_for(stage2) is job_for(STAGE0) and job_for(stage2).name(stage2) == "stage2"  # one job, named per stage
    with pytest.raises(KeyError):
        job_for({"stage": 0})  # a dict is no typed config


def test_each_job_names_its_recipe():
    from pipelines.train.recipes.stage import STAGE
    from pipelines.train.recipes.stage4 import DISTILLATION
    from pipelines.train.recipes.traffic import TRAFFIC
    from pipelines.train.recipes.retriever import RETRIEVER as RETRIEVER_RECIPE
    from pipelines.train.recipes.ul2 import UL2

    assert [job.recipe() for job in (StageJob(), Stage4Job(), Ul2Job(), TrafficJob(), RetrieverJob())] == [
        STAGE, DISTILLATION, UL2, TRAFFIC, RETRIEVER_RECIPE]


def test_dry_run_lines():
    header, plan = job_for(STAGE0).dry_run(STAGE0)
    assert header == "# memory plan (scaling.use_gpu is false: the same workers as GPUs)"
    assert plan.startswith("ZeRO-2: as configured\npair tiny-shared: 1 node(s) x 2 GPU(s)") and "\nfits: " in plan
    on_gpus = dataclasses.replace(STAGE0, scaling=dataclasses.replace(STAGE0.scaling, use_gpu=True))
    assert job_for(on_gpus).dry_run(on_gpus)[0] == "# memory plan"
    assert job_for(ENCODER_UL2).dry_run(ENCODER_UL2) == [] and job_for(RETRIEVER).dry_run(RETRIEVER) == []
    header, model = job_for(TRAFFIC_VLM).dry_run(TRAFFIC_VLM)
    m = TRAFFIC_VLM.model
    assert header == "# model" and model.startswith(
        f"vision tokens: {(m.image_size // m.patch_size) ** 2} ({m.image_size}/{m.patch_size} squared, width "
        f"{m.vision_hidden_size}); parameters: vision ")  # 196 tokens at 224 / 16
    assert model.endswith(f"(vocab {m.vocab_size}, hidden {m.hidden_size}, {m.layers} layers, {m.heads} q / "
                          f"{m.kv_heads} kv heads)")


def test_resolved_paths_are_absolute_and_a_random_pair_gets_its_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = dataclasses.replace(
        STAGE4, run=dataclasses.replace(STAGE4.run, storage_path="runs"),
        data=dataclasses.replace(STAGE4.data, train_path="corpus/train", val_path="s3://bucket/corpus/val"),
        model=dataclasses.replace(STAGE4.model, init_from="runs/export", encoder_checkpoint="~/encoder"),
        distill=dataclasses.replace(STAGE4.distill, teacher="teacher/export"))
    resolved = job_for(config).resolved(config)
    assert resolved.run.storage_path == str(tmp_path / "runs")
    assert resolved.data.train_path == str(tmp_path / "corpus" / "train")
    assert resolved.data.val_path == "s3://bucket/corpus/val"  # a URL stays as given
    # what the workers read, as a worker does not start in the driver's directory
    assert resolved.model.init_from == str(tmp_path / "runs" / "export")
    assert resolved.model.encoder_checkpoint == str(Path("~/encoder").expanduser())
    assert resolved.distill.teacher == str(tmp_path / "teacher" / "export") and resolved.distill.logits is None
    assert resolved.model.checkpoint_root == str(Path(default_tiny_root()).expanduser().resolve())
    rooted = dataclasses.replace(config, model=dataclasses.replace(config.model, checkpoint_root="ckpt"))
    assert job_for(rooted).resolved(rooted).model.checkpoint_root == str(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()  # named only: written when the job runs
    for other in (ENCODER_UL2, TRAFFIC_VLM):
        moved = dataclasses.replace(other, run=dataclasses.replace(other.run, storage_path="runs"))
        assert job_for(moved).resolved(moved).run.storage_path == str(tmp_path / "runs")


def test_a_stage_job_checks_its_shards_first(tmp_path):
    assert job_for(STAGE0).check(STAGE0) == {}  # synthetic needles: nothing to check
    split = write_split(tmp_path, token_rows(12), files=3, row_group_rows=4)
    config = dataclasses.replace(STAGE0, data=dataclasses.replace(STAGE0.data, train_path=str(split)))
    checked = job_for(config).check(config)
    assert checked["shards"] == 3 and checked["hashed"] is True and checked["seconds"] >= 0
    assert job_for(ENCODER_UL2).check(ENCODER_UL2) == {} and job_for(TRAFFIC_VLM).check(TRAFFIC_VLM) == {}
