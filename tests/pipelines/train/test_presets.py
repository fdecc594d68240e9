"""The jobs' embedded defaults (pipelines/train/presets.py): every preset validates as it stands (stages 1 and 2 ask
only for their corpus, and validate once given one), crosses the Ray Train boundary as a dict unchanged, and the
sweepable stages are the stage jobs' own presets; the beyond-lexical preset is what docs/jobs.md says it is."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pipelines.cli import parse_config
from pipelines.train import presets
from pipelines.train.presets import (BEYOND_LEXICAL, ENCODER_UL2, RETRIEVER, STAGE0, STAGE1, STAGE2, STAGE4, STAGES,
                                    TRAFFIC_VLM)

READY = {"STAGE0": STAGE0, "BEYOND_LEXICAL": BEYOND_LEXICAL, "STAGE4": STAGE4, "ENCODER_UL2": ENCODER_UL2,
         "TRAFFIC_VLM": TRAFFIC_VLM, "RETRIEVER": RETRIEVER}


@pytest.mark.parametrize("name", sorted(READY))
def test_presets_that_need_no_corpus_validate(name):
    preset = READY[name]
    assert preset.problems() == []
    assert preset.validate() is preset
    assert type(preset).from_dict(preset.to_dict()) == preset  # as the workers receive it


@pytest.mark.parametrize("preset", [STAGE1, STAGE2], ids=["stage1", "stage2"])
def test_corpus_stages_ask_only_for_their_corpus(preset, tmp_path):
    (problem,) = preset.problems()
    assert problem.startswith(f"stage {preset.stage} trains on commit shards") and "--data.train_path" in problem
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    given = dataclasses.replace(preset, data=dataclasses.replace(preset.data, train_path=str(tmp_path / "train"),
                                                                 val_path=str(tmp_path / "val")))
    assert given.problems() == []
    assert type(preset).from_dict(preset.to_dict()) == preset


def test_the_corpus_stages_fix_names_a_flag_build_corpus_takes():
    (problem,) = STAGE1.problems()
    assert "--sources REPO" in problem


def test_the_sweepable_stages_are_the_stage_jobs_presets():
    assert STAGES == {0: STAGE0, 1: STAGE1, 2: STAGE2}
    assert RETRIEVER.needle == STAGE0.needle  # the retriever learns what the stage-0 reader learns
    assert all(preset.stage == stage for stage, preset in STAGES.items()) and STAGE4.stage == 4
    names = [p.run.name for p in (STAGE0, BEYOND_LEXICAL, STAGE1, STAGE2, STAGE4, ENCODER_UL2, TRAFFIC_VLM, RETRIEVER)]
    assert len(set(names)) == len(names)  # each job's runs under its own name
    assert {k for k, v in vars(presets).items() if k.isupper() and hasattr(v, "problems")} == {
        "STAGE0", "BEYOND_LEXICAL", "STAGE1", "STAGE2", "STAGE4", "ENCODER_UL2", "TRAFFIC_VLM",
        "RETRIEVER"}  # a new preset: a test


def test_the_beyond_lexical_preset_is_stage0_with_the_flags_its_docs_table_names():
    """docs/jobs.md lists, as jobs/stage0.py flags, where the preset differs from make demo's: those flags on STAGE0
    must give the preset exactly (its run name aside), so the table and the code cannot drift apart."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "jobs.md").read_text()
    section = text.split("### Questions retrieval cannot match")[1].split("\n### ")[0]
    table = section.split("| option | what it does, and why |")[1].split("\n\n")[0]
    flags = [flag for cell in re.findall(r"^\| `([^`]+)` \|", table, re.M) for flag in cell.split()]
    assert len(flags) > 10, table
    documented = parse_config(flags, STAGE0)
    assert documented == dataclasses.replace(BEYOND_LEXICAL, run=STAGE0.run)
