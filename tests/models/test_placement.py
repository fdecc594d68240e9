import pytest

from models.placement import resolve_gca_layers


@pytest.mark.parametrize(
    ("spec", "depth", "expected"),
    [
        ("upper_third", 36, list(range(24, 36))),  # Qwen3-8B
        ("upper_third", 48, list(range(32, 48))),  # Qwen3-30B-A3B
        ("upper_third", 28, list(range(19, 28))),  # Qwen3-0.6B
        ("upper_third", 40, list(range(27, 40))),  # Qwen3-14B
        ("upper_half", 36, list(range(18, 36))),
        ("every_k:4", 36, [3, 7, 11, 15, 19, 23, 27, 31, 35]),
        ("every_k:2", 5, [0, 2, 4]),
        ("last:4", 36, [32, 33, 34, 35]),
        ([5, 1, 3], 8, [1, 3, 5]),
        ("3, 1", 8, [1, 3]),
    ],
)
def test_placements(spec, depth, expected):
    assert resolve_gca_layers(spec, depth) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([4], "outside the decoder's 4 layers"),
        ([-1], "outside the decoder's 4 layers"),
        ("last:9", "outside the decoder's 4 layers"),
        ([], "selects no layer of a 4-layer decoder"),
        ("upper_third", "selects no layer of a 2-layer decoder"),
        ("every_k:0", "positive integer"),
        ("top", "unknown GCA placement"),
        ([1, 1], "repeats a layer"),
    ],
)
def test_bad_placements_name_the_depth(spec, message):
    depth = 2 if spec == "upper_third" else 4
    with pytest.raises(ValueError, match=message):
        resolve_gca_layers(spec, depth)
