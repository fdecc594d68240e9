"""The traffic VLM job's parts without Ray: config errors collected with their fixes, --dry-run and a wrong flag as a
user meets them, the held-out metrics against scikit-learn's, the training batch as the model reads it. Its
figures: tests/pipelines/evaluate/test_plots.py. The job through Ray Train is tests/jobs/test_traffic_vlm_job.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import confusion_matrix, f1_score, precision_score, recall_score

from pipelines.cli import parse_config
from pipelines.data.traffic_scenes import QUESTION_TYPES, QUESTIONS, make_row, scene_seeds, split_of
from pipelines.data.traffic_tokenizer import build_traffic_tokenizer
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.presets import TRAFFIC_VLM
from pipelines.train.recipes.traffic import collate, collate_scene_questions, count_outcomes, metrics_from_counts

ROOT = Path(__file__).resolve().parents[4]


def test_config_errors_are_collected_and_name_the_fix(tmp_path, capsys):
    (tmp_path / "siglip").mkdir()
    (tmp_path / "siglip" / "config.json").write_text(json.dumps({"vision_config": {"image_size": 384}}))
    with pytest.raises(SystemExit) as exit:
        parse_config(["--model.image_size", "100", "--data.question_types", "light_red", "flying_cars",
                      "--train.memories_per_step", "33", "--model.vocab_size", "50", "--model.kv_heads", "3"],
                     TrafficConfig())
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    for expected, line in zip(("multiple of model.patch_size", "multiple of model.kv_heads", "vocab_size (50)",
                               "['flying_cars']", "divide evenly"), lines, strict=True):
        assert expected in line, line  # one line per problem
    problems = TrafficConfig.from_dict({"model": {"vision_path": str(tmp_path / "siglip")}}).problems()
    assert problems == ["model.image_size (224) differs from the checkpoint's image_size (384): pass "
                        "--model.image_size 384"]
    assert "holds no config.json" in TrafficConfig.from_dict({"model": {"vision_path": str(tmp_path)}}).problems()[0]
    assert TRAFFIC_VLM.problems() == []


def test_dry_run_help_and_a_wrong_flag_as_processes(tmp_path):
    """As a user runs them: --dry-run prints the resolved config and the model's shape without Ray; a wrong flag is
    one line and exit 2; --help shows the fields' docs."""
    job = [sys.executable, str(ROOT / "jobs" / "traffic_vlm.py")]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    started = [subprocess.Popen([*job, *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
               for args in (["--dry-run"], ["--train.max_step", "5"], ["--help"])]
    (dry, _), (_, wrong), (help_text, _) = (p.communicate(timeout=300) for p in started)
    assert [p.returncode for p in started] == [0, 2, 0]
    assert dry.startswith("# resolved config") and f"storage_path: {tmp_path / 'outputs' / 'ray'}" in dry
    assert "vision tokens: 196 (224/16 squared" in dry and "decoder 18.16M" in dry
    assert not (tmp_path / "outputs").exists()
    assert wrong.strip() == "traffic_vlm.py: unknown config key 'train.max_step'; did you mean --train.max_steps?"
    for doc in ("--data.train_scenes", "the first N seeds of the train split", "--model.vision_path", "--dry-run"):
        assert doc in help_text, doc


def test_metrics_match_scikit_learn():
    rng = np.random.default_rng(0)
    types = QUESTION_TYPES
    kinds = rng.choice(len(types), 200)
    questions = [QUESTIONS[types[k]] for k in kinds]
    truth = torch.from_numpy(rng.random(200) < 0.45)
    seen = torch.where(torch.from_numpy(rng.random(200) < 0.8), truth, ~truth)
    withheld = torch.from_numpy(rng.random(200) < 0.5)
    metrics = metrics_from_counts(count_outcomes(seen, withheld, truth, questions, types), types)
    y, p = truth.numpy(), seen.numpy()
    assert metrics["accuracy"] == pytest.approx((y == p).mean())
    assert metrics["no_image_accuracy"] == pytest.approx((y == withheld.numpy()).mean())
    assert metrics["majority_accuracy"] == pytest.approx(max(y.mean(), 1 - y.mean()))
    assert metrics["f1"] == pytest.approx(f1_score(y, p))
    assert metrics["precision"] == pytest.approx(precision_score(y, p))
    assert metrics["recall"] == pytest.approx(recall_score(y, p))
    (tn, fp), (fn, tp) = confusion_matrix(y, p)
    assert [metrics[f"confusion/{k}"] for k in ("tp", "fp", "tn", "fn")] == [tp, fp, tn, fn]
    for i, kind in enumerate(types):
        assert metrics[f"accuracy/{kind}"] == pytest.approx((y == p)[kinds == i].mean())


def test_collate_reads_the_rows_as_the_model_does():
    seeds = scene_seeds("train", 6)
    assert all(split_of(s) == "train" for s in seeds) and seeds == sorted(seeds)
    assert not set(seeds) & set(scene_seeds("heldout", 50))
    rows = [make_row(s) for s in seeds]
    batch = collate({k: np.array([r[k] for r in rows], dtype=object) for k in ("png", "question", "answer")}, 64)
    assert batch["pixel_values"].shape == (6, 3, 64, 64)
    assert batch["labels"].tolist() == [0 if r["answer"] == "yes" else 1 for r in rows]  # 0 = [YES]
    lengths = batch["attention_mask"].sum(-1)
    assert all(batch["input_ids"][i, :n].tolist()[0] == 1 for i, n in enumerate(lengths.tolist()))  # [BOS] first
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()  # right-padded with [PAD]


def test_collate_packed_asks_every_question_of_a_scene_in_a_shuffled_order():
    rows = [make_row(s) for s in scene_seeds("train", 4)]
    columns = {k: np.array([r[k] for r in rows], dtype=object) for k in ("png", "scene_questions", "scene_answers")}
    batch = collate_scene_questions(columns, 64, np.random.default_rng(0))
    assert batch["pixel_values"].shape == (4, 3, 64, 64) and "attention_mask" not in batch
    assert batch["answer_positions"].shape == batch["labels"].shape == (4, len(QUESTION_TYPES))
    tokenizer = build_traffic_tokenizer()
    orders = set()
    for b, row in enumerate(rows):
        ids, positions = batch["input_ids"][b].tolist(), batch["position_ids"][b].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0]
        asked = []
        for q, end in enumerate(batch["answer_positions"][b].tolist()):
            start = max(s for s in starts if s <= end)
            assert ids[start] == tokenizer.token_to_id("[BOS]") and positions[start:end + 1] == list(range(end - start + 1))
            text = tokenizer.decode(ids[start:end + 1])
            k = [tokenizer.decode(tokenizer.encode(t).ids) for t in row["scene_questions"]].index(text)
            asked.append(k)
            assert batch["labels"][b, q] == (0 if row["scene_answers"][k] == "yes" else 1)  # 0 = [YES]
        assert sorted(asked) == list(range(len(QUESTION_TYPES)))
        orders.add(tuple(asked))
        tail = max(batch["answer_positions"][b].tolist()) + 1
        assert set(ids[tail:]) <= {0} and positions[tail:] == list(range(len(ids) - tail))  # [PAD] tail
    assert len(orders) > 1  # shuffled row by row
