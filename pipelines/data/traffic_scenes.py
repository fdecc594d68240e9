"""Synthetic traffic scenes for the traffic-scene VLM: a scene is a function of its seed, rendered offline.

A scene (`Scene`) is a small description: the traffic light's colour, which lanes hold cars, whether a pedestrian
stands on the crosswalk, whether a stop sign stands at the roadside, plus distractors that answer nothing (a
pedestrian on the sidewalk, a blue round sign, car colours and places). `render` draws it top-down with Pillow at
224x224: grey road with a dashed centre line (left and right lane), zebra crosswalk, cars as coloured rectangles,
pedestrians as dots with a body, the light as a dark box with a lit lamp (red on top, green below), signs on the
sidewalk. Each scene answers one question (`QUESTIONS`), and its answers follow from its description alone
(`answer`).

Balance: a seed chooses its question type (`seed % n_types`) and that question's answer (`(seed // n_types) % 2`),
and the scene is built so that the answer holds (the rest of the scene is random from the seed). So every run of
`2 * n_types` consecutive seeds holds each question type once with YES and once with NO. The held-out split is
chosen by a hash of the seed (`split_of`): a scene is in exactly one split.

`build_dataset` is the thin Ray Data part: `ray.data.range(n).map_batches(render_batch)`.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray.data
from PIL import Image, ImageDraw

SIZE = 224  # scenes are drawn at 224x224; `render(size=...)` resizes
ROAD = (56, 168)  # road x-range; the centre line at x=112 splits it into the left and right lane
LANES = {"left": (56, 112), "right": (112, 168)}
CROSSWALK = (128, 156)  # crosswalk y-range, across the whole road
LIGHT_BOX = (180, 16, 208, 76)  # the traffic light's housing (x0, y0, x1, y1) on the right sidewalk
LAMPS = {"red": (194, 32), "green": (194, 60)}  # lamp centres; radius LAMP_RADIUS
LAMP_RADIUS = 9
STOP_SIGN = (28, 40)  # centre of the stop sign on the left sidewalk
INFO_SIGN = (28, 190)  # centre of the distractor (blue, round) sign
CAR_SLOTS = (20, 70, 176)  # car top y positions in a lane (clear of the crosswalk)
CAR_SIZE = (36, 40)  # width, height
CAR_COLOURS = ((40, 80, 220), (230, 210, 40), (245, 245, 245), (140, 60, 170), (20, 20, 20))  # never red or green

BG, ROAD_GREY, LINE_WHITE = (205, 190, 160), (90, 90, 95), (240, 240, 240)
LAMP_ON = {"red": (235, 25, 25), "green": (30, 220, 60)}
LAMP_OFF = (50, 50, 50)

QUESTIONS: dict[str, str] = {
    "light_red": "Is the light red?",
    "pedestrian_on_crosswalk": "Is there a pedestrian on the crosswalk?",
    "left_lane_free": "Is the left lane free?",
    "right_lane_free": "Is the right lane free?",
    "stop_sign": "Is there a stop sign?",
    "can_go": "Can the car go?",
}
QUESTION_TYPES = tuple(QUESTIONS)


@dataclass(frozen=True)
class Scene:
    """What a traffic scene holds; answers are read off these fields (`answer`)."""

    seed: int
    light: str  # "red" | "green"
    pedestrian_on_crosswalk: bool
    cars: dict[str, tuple[int, ...]]  # lane -> car slot indices (empty: the lane is free)
    stop_sign: bool
    pedestrian_on_sidewalk: bool = False  # distractor
    info_sign: bool = False  # distractor
    car_colours: tuple[int, ...] = field(default=())  # colour index per car, in lane order left then right
    question: str = "light_red"  # the question type this scene was built to answer
    answer_yes: bool = True


def answer(scene: Scene, question: str) -> bool:
    """The answer to a question type, from the scene's description alone."""
    facts = {
        "light_red": scene.light == "red",
        "pedestrian_on_crosswalk": scene.pedestrian_on_crosswalk,
        "left_lane_free": not scene.cars["left"],
        "right_lane_free": not scene.cars["right"],
        "stop_sign": scene.stop_sign,
        "can_go": scene.light == "green" and not scene.pedestrian_on_crosswalk,
    }
    return facts[question]


def question_for(seed: int, question_types: tuple[str, ...] = QUESTION_TYPES) -> tuple[str, bool]:
    """The question type a seed asks and the answer it is built to have: balanced over consecutive seeds."""
    n = len(question_types)
    return question_types[seed % n], (seed // n) % 2 == 0


def make_scene(seed: int, question_types: tuple[str, ...] = QUESTION_TYPES) -> Scene:
    """A random scene from `seed`, then adjusted so that its question (`question_for`) has its chosen answer."""
    rng = np.random.default_rng([seed, 0x7AFF1C])
    question, yes = question_for(seed, question_types)
    light = str(rng.choice(["red", "green"]))
    pedestrian = bool(rng.random() < 0.5)
    cars = {lane: _lane_cars(rng, occupied=bool(rng.random() < 0.5)) for lane in LANES}
    stop_sign = bool(rng.random() < 0.5)
    if question == "light_red":
        light = "red" if yes else "green"
    elif question == "pedestrian_on_crosswalk":
        pedestrian = yes
    elif question in ("left_lane_free", "right_lane_free"):
        cars[question.split("_")[0]] = _lane_cars(rng, occupied=not yes)
    elif question == "stop_sign":
        stop_sign = yes
    elif question == "can_go":
        if yes:
            light, pedestrian = "green", False
        elif light == "green" and not pedestrian:  # make it a NO: a red light, a pedestrian, or both
            light, pedestrian = [("red", False), ("green", True), ("red", True)][int(rng.integers(3))]
    n_cars = sum(len(v) for v in cars.values())
    scene = Scene(seed=seed, light=light, pedestrian_on_crosswalk=pedestrian, cars=cars, stop_sign=stop_sign,
                  pedestrian_on_sidewalk=bool(rng.random() < 0.5), info_sign=bool(rng.random() < 0.5),
                  car_colours=tuple(int(c) for c in rng.integers(len(CAR_COLOURS), size=n_cars)),
                  question=question, answer_yes=yes)
    assert answer(scene, question) == yes, (seed, question)
    return scene


def _lane_cars(rng: np.random.Generator, *, occupied: bool) -> tuple[int, ...]:
    """Slot indices of the cars in one lane: none when free, else one or two distinct slots."""
    if not occupied:
        return ()
    return tuple(sorted(int(s) for s in rng.choice(len(CAR_SLOTS), size=int(rng.integers(1, 3)), replace=False)))


def render(scene: Scene, size: int = SIZE) -> Image.Image:
    """The scene drawn top-down as an RGB image of `size` x `size` (drawn at 224, resized if smaller)."""
    image = Image.new("RGB", (SIZE, SIZE), BG)
    draw = ImageDraw.Draw(image)
    draw.rectangle((ROAD[0], 0, ROAD[1] - 1, SIZE - 1), fill=ROAD_GREY)
    for y in range(0, SIZE, 24):  # dashed centre line
        draw.rectangle((110, y, 113, y + 12), fill=LINE_WHITE)
    for x in range(ROAD[0] + 2, ROAD[1] - 4, 12):  # zebra stripes
        draw.rectangle((x, CROSSWALK[0], x + 6, CROSSWALK[1]), fill=LINE_WHITE)
    colours = iter(scene.car_colours)
    for lane, slots in scene.cars.items():
        x0 = LANES[lane][0] + (LANES[lane][1] - LANES[lane][0] - CAR_SIZE[0]) // 2
        for slot in slots:
            y0 = CAR_SLOTS[slot]
            draw.rectangle((x0, y0, x0 + CAR_SIZE[0], y0 + CAR_SIZE[1]), fill=CAR_COLOURS[next(colours)],
                           outline=(0, 0, 0), width=2)
    if scene.pedestrian_on_crosswalk:
        _pedestrian(draw, 84 + (scene.seed % 3) * 24, (CROSSWALK[0] + CROSSWALK[1]) // 2)
    if scene.pedestrian_on_sidewalk:
        _pedestrian(draw, 196, 120 + (scene.seed % 4) * 20)
    draw.rectangle(LIGHT_BOX, fill=(25, 25, 25))
    for colour, (cx, cy) in LAMPS.items():
        fill = LAMP_ON[colour] if scene.light == colour else LAMP_OFF
        draw.ellipse((cx - LAMP_RADIUS, cy - LAMP_RADIUS, cx + LAMP_RADIUS, cy + LAMP_RADIUS), fill=fill)
    if scene.stop_sign:
        cx, cy = STOP_SIGN
        angles = np.deg2rad(22.5 + 45 * np.arange(8))
        draw.polygon([(cx + 16 * np.cos(a), cy + 16 * np.sin(a)) for a in angles], fill=(200, 20, 20),
                     outline=LINE_WHITE)
        draw.rectangle((cx - 1, cy + 16, cx + 1, cy + 30), fill=(60, 60, 60))
    if scene.info_sign:
        cx, cy = INFO_SIGN
        draw.ellipse((cx - 13, cy - 13, cx + 13, cy + 13), fill=(30, 70, 200), outline=LINE_WHITE)
    return image if size == SIZE else image.resize((size, size), Image.Resampling.BILINEAR)


def _pedestrian(draw: ImageDraw.ImageDraw, x: int, y: int) -> None:
    """A person seen from above: an orange body and a skin-coloured head, 20 x 28 px (at 14 x 19 a from-scratch tower
    had not learnt to see one on the zebra stripes after 450 steps, while it read the 18-px lamps)."""
    draw.ellipse((x - 10, y - 7, x + 10, y + 13), fill=(240, 120, 20))
    draw.ellipse((x - 6, y - 15, x + 6, y - 3), fill=(250, 200, 160))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def split_of(seed: int, heldout_fraction: float = 0.2) -> str:
    """'heldout' or 'train', from a hash of the seed alone: no scene lies in both splits."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little", signed=True), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "little") / 2**64 < heldout_fraction else "train"


def make_row(seed: int, *, size: int = SIZE, heldout_fraction: float = 0.2,
             question_types: tuple[str, ...] = QUESTION_TYPES) -> dict[str, Any]:
    """One dataset row: {png, question, answer ('yes'/'no'), seed, split} and every question type's answer about the
    same scene (scene_questions, scene_answers: training asks them all at once, `pipelines.data.traffic_batches`)."""
    scene = make_scene(seed, question_types)
    return {"png": png_bytes(render(scene, size)), "question": QUESTIONS[scene.question],
            "answer": "yes" if scene.answer_yes else "no", "seed": seed, "split": split_of(seed, heldout_fraction),
            "scene_questions": [QUESTIONS[q] for q in question_types],
            "scene_answers": ["yes" if answer(scene, q) else "no" for q in question_types]}


COLUMNS = ("png", "question", "answer", "seed", "split", "scene_questions", "scene_answers")


def render_batch(batch: dict[str, np.ndarray], *, size: int = SIZE, heldout_fraction: float = 0.2,
                 question_types: tuple[str, ...] = QUESTION_TYPES) -> dict[str, list]:
    """A Ray Data batch of seeds ({'id': (N,)}) -> the columns of `make_row` (COLUMNS)."""
    rows = [make_row(int(s), size=size, heldout_fraction=heldout_fraction, question_types=question_types)
            for s in batch["id"]]
    return {key: [row[key] for row in rows] for key in COLUMNS}


def build_dataset(n: int, *, size: int = SIZE, heldout_fraction: float = 0.2, batch_size: int = 64,
                  question_types: tuple[str, ...] = QUESTION_TYPES):
    """A Ray Data dataset of `n` scenes (seeds 0..n-1), one question each; filter on `split` for the held-out set."""
    return ray.data.range(n).map_batches(
        render_batch, batch_size=batch_size,
        fn_kwargs={"size": size, "heldout_fraction": heldout_fraction, "question_types": question_types})


def pixel_values(images: list[Image.Image] | list[bytes], size: int | None = None) -> np.ndarray:
    """Images (PIL or PNG bytes) -> (N, 3, H, W) float32 in [-1, 1], SigLIP's normalisation (mean 0.5, std 0.5)."""
    arrays = []
    for image in images:
        if isinstance(image, bytes | bytearray):
            image = Image.open(io.BytesIO(image))
        image = image.convert("RGB")
        if size is not None and image.size != (size, size):
            image = image.resize((size, size), Image.Resampling.BILINEAR)
        arrays.append(np.asarray(image, dtype=np.float32).transpose(2, 0, 1))  # (3, H, W)
    return np.stack(arrays) / 127.5 - 1.0


def scene_seeds(split: str, count: int, heldout_fraction: float = 0.2) -> list[int]:
    """The first `count` seeds (from 0 up) that `split_of` puts in `split`: a split's scenes, in a stable order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    seeds, seed = [], 0
    while len(seeds) < count:
        if split_of(seed, heldout_fraction) == split:
            seeds.append(seed)
        seed += 1
    return seeds


def build_split(split: str, count: int, *, size: int = SIZE, heldout_fraction: float = 0.2, batch_size: int = 64,
                question_types: tuple[str, ...] = QUESTION_TYPES):
    """A Ray Data dataset of one split's first `count` scenes (`scene_seeds`), rendered by `render_batch`."""
    seeds = scene_seeds(split, count, heldout_fraction)
    return ray.data.from_items([{"id": s} for s in seeds]).map_batches(
        render_batch, batch_size=batch_size,
        fn_kwargs={"size": size, "heldout_fraction": heldout_fraction, "question_types": question_types})
