"""Synthetic traffic scenes: deterministic per seed, answers that follow from the description (and show in the
pixels), YES/NO balance per question type, splits disjoint by seed; one small Ray Data build."""

from __future__ import annotations

import dataclasses
import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from pipelines.data.traffic_scenes import (
    CROSSWALK,
    LAMP_RADIUS,
    LAMPS,
    LANES,
    QUESTION_TYPES,
    QUESTIONS,
    STOP_SIGN,
    answer,
    build_dataset,
    make_row,
    make_scene,
    pixel_values,
    render,
    render_batch,
    split_of,
)


def red_ish(rgb: np.ndarray) -> bool:
    r, g, b = (int(v) for v in rgb)
    return r > 180 and g < 80 and b < 80


def green_ish(rgb: np.ndarray) -> bool:
    r, g, b = (int(v) for v in rgb)
    return g > 180 and r < 80 and b < 120


def test_scene_is_a_function_of_its_seed():
    assert make_scene(17) == make_scene(17)
    assert make_row(17) == make_row(17)  # the PNG bytes too
    assert np.array_equal(np.asarray(render(make_scene(17))), np.asarray(render(make_scene(17))))
    assert len({make_row(s)["png"] for s in range(12)}) == 12


def test_rendered_size_and_png():
    row = make_row(3)
    assert Image.open(io.BytesIO(row["png"])).size == (224, 224)
    assert render(make_scene(3), size=64).size == (64, 64)
    values = pixel_values([row["png"]], size=64)
    assert values.shape == (1, 3, 64, 64) and values.dtype == np.float32
    assert values.min() >= -1.0 and values.max() <= 1.0


def test_red_light_scene_answers_yes_and_its_lamp_is_red():
    base = make_scene(0)
    red = dataclasses.replace(base, light="red")
    green = dataclasses.replace(base, light="green")
    assert answer(red, "light_red") and not answer(green, "light_red")
    assert not answer(red, "can_go")
    red_pixels, green_pixels = np.asarray(render(red)), np.asarray(render(green))
    (rx, ry), (gx, gy) = LAMPS["red"], LAMPS["green"]
    assert red_ish(red_pixels[ry, rx]) and not green_ish(red_pixels[gy, gx])
    assert green_ish(green_pixels[gy, gx]) and not red_ish(green_pixels[ry, rx])
    # the lamp disc is lit across its radius, not one pixel
    assert red_ish(red_pixels[ry + LAMP_RADIUS // 2, rx - LAMP_RADIUS // 2])


@pytest.mark.parametrize("seed", range(60))
def test_built_answer_holds_and_shows_in_pixels(seed):
    scene = make_scene(seed)
    assert answer(scene, scene.question) == scene.answer_yes
    pixels = np.asarray(render(scene)).astype(int)
    lit = LAMPS[scene.light]
    assert (red_ish if scene.light == "red" else green_ish)(pixels[lit[1], lit[0]])
    # a car in a lane changes the lane's pixels away from the bare road's grey
    for lane, (x0, x1) in LANES.items():
        rows = np.r_[0:CROSSWALK[0] - 12, CROSSWALK[1] + 12:224]  # off the crosswalk (and its pedestrian)
        strip = pixels[rows, x0 + 4:x1 - 4]  # inside the lane, clear of the centre line
        has_car = bool((np.abs(strip - np.array([90, 90, 95])).sum(-1) > 60).mean() > 0.05)
        assert has_car == bool(scene.cars[lane]), (seed, lane)
    orange = (pixels[..., 0] > 220) & (np.abs(pixels[..., 1] - 120) < 20) & (pixels[..., 2] < 50)  # pedestrian body
    on_crosswalk = orange[CROSSWALK[0] - 12:CROSSWALK[1] + 12, 56:168].any()
    assert bool(on_crosswalk) == scene.pedestrian_on_crosswalk
    sx, sy = STOP_SIGN
    assert red_ish(pixels[sy, sx]) == scene.stop_sign


def test_questions_balanced_per_type():
    rows = [make_row(s, size=32) for s in range(240)]
    counts = Counter((r["question"], r["answer"]) for r in rows)
    for question in QUESTIONS.values():
        assert counts[(question, "yes")] == counts[(question, "no")] == 20
    # the held-out split, chosen by hash, stays balanced within a tolerance
    heldout = [r for r in [make_row(s, size=32) for s in range(1200)] if r["split"] == "heldout"]
    for question in QUESTIONS.values():
        answers = [r["answer"] for r in heldout if r["question"] == question]
        assert 0.35 < answers.count("yes") / len(answers) < 0.65, question


def test_answers_are_not_all_from_one_field():
    """Distractors vary independently: a scene's other answers are mixed, so one field cannot answer everything."""
    scenes = [make_scene(s) for s in range(300)]
    for question in QUESTION_TYPES:
        others = [answer(s, question) for s in scenes if s.question != question]
        assert 0.2 < np.mean(others) < 0.8, question


def test_splits_disjoint_by_seed_and_near_fraction():
    splits = {s: split_of(s, 0.2) for s in range(5000)}
    assert set(splits.values()) == {"train", "heldout"}
    assert 0.17 < sum(v == "heldout" for v in splits.values()) / 5000 < 0.23
    assert all(split_of(s, 0.2) == splits[s] for s in range(0, 5000, 7))  # stable


def test_render_batch_columns():
    out = render_batch({"id": np.arange(4)}, size=32)
    assert set(out) == {"png", "question", "answer", "seed", "split", "scene_questions", "scene_answers"}
    assert out["seed"] == [0, 1, 2, 3] and all(isinstance(p, bytes) for p in out["png"])
    for seed, questions, answers in zip(out["seed"], out["scene_questions"], out["scene_answers"]):
        scene = make_scene(seed)  # every question about the scene, its own among them with the same answer
        assert questions == [QUESTIONS[q] for q in QUESTION_TYPES]
        assert answers == ["yes" if answer(scene, q) else "no" for q in QUESTION_TYPES]
        assert answers[QUESTION_TYPES.index(scene.question)] == out["answer"][seed]


@pytest.mark.ray
def test_ray_dataset_build(ray_local):
    rows = build_dataset(48, size=32, batch_size=16).take_all()
    assert sorted(r["seed"] for r in rows) == list(range(48))
    train = {r["seed"] for r in rows if r["split"] == "train"}
    heldout = {r["seed"] for r in rows if r["split"] == "heldout"}
    assert train and heldout and not train & heldout
    assert all(r == make_row(r["seed"], size=32) for r in rows[:5])
