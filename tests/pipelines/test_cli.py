"""The one command line every job shares: default < --config FILE < --section.field flags, lists as lists, field
docs in --help, and every user error as one stderr line with exit status 2."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from pipelines.cli import ConfigError, field_docs, from_typed_dict, inline, parse_config, peek, to_dict
from pipelines.train.configs.stage import StageConfig


@dataclass
class Inner:
    names: list[str] = field(default_factory=lambda: ["a", "b"])  # names to keep
    sizes: tuple[int, ...] = (4, 8)
    rate: float = 0.1  # how fast
    mode: Literal["fast", "slow"] = "fast"  # how to run


@dataclass
class Outer:
    steps: int = 10  # how many steps
    flag: bool = False
    path: str | None = None
    inner: Inner = field(default_factory=Inner)

    def problems(self) -> list[str]:
        return [f"steps must be positive, got {self.steps}"] if self.steps <= 0 else []


def errors(capsys, argv) -> list[str]:
    with pytest.raises(SystemExit) as exit:
        parse_config(argv, Outer())
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()


def test_merge_order_default_then_file_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 20\ninner:\n  rate: 0.5\n  names: [x, y, z]\n")
    config = parse_config(["--config", str(path), "--steps", "30"], Outer())
    assert (config.steps, config.inner.rate, config.inner.names) == (30, 0.5, ["x", "y", "z"])
    assert parse_config(["--config", str(path)], Outer()).steps == 20


def test_lists_parse_as_lists():
    config = parse_config(["--inner.names", "p", "q", "--inner.sizes", "1", "2", "3"], Outer())
    assert config.inner.names == ["p", "q"] and config.inner.sizes == (1, 2, 3)
    assert parse_config(["--inner.names", "[p, q]"], Outer()).inner.names == ["p", "q"]  # a YAML list too
    assert parse_config(["--inner.names", "only"], Outer()).inner.names == ["only"]
    assert parse_config(["--flag", "--path", "none"], Outer()).flag is True  # a bare bool flag sets it


def test_wrong_value_is_one_line_naming_the_key(capsys):
    [line] = errors(capsys, ["--steps", "abc"])
    assert "steps expects int, got 'abc'" in line
    [line] = errors(capsys, ["--inner.sizes", "1", "x"])
    assert "inner.sizes" in line


def test_unknown_key_suggests_the_closest(capsys):
    [line] = errors(capsys, ["--inner.rat", "1"])
    assert "unknown config key 'inner.rat'; did you mean --inner.rate?" in line


def test_unknown_key_in_a_file_and_problems_are_one_line_each(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("inner:\n  nmes: [a]\n")
    [line] = errors(capsys, ["--config", str(path)])
    assert "'inner.nmes'; did you mean --inner.names?" in line
    [line] = errors(capsys, ["--steps", "0"])
    assert line.endswith("steps must be positive, got 0")


def test_help_shows_field_docs(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_config(["--help"], Outer())
    assert exit.value.code == 0
    out = capsys.readouterr().out
    for text in ("how many steps", "names to keep", "how fast", "--inner.rate", "default: a b"):
        assert text in out, text


def test_a_choice_field_takes_only_its_choices_and_help_names_them(capsys):
    assert parse_config(["--inner.mode", "slow"], Outer()).inner.mode == "slow"
    [line] = errors(capsys, ["--inner.mode", "medium"])
    assert line.endswith("inner.mode must be one of ('fast', 'slow'), got 'medium': e.g. --inner.mode fast")
    with pytest.raises(SystemExit):
        parse_config(["--help"], Outer())
    assert "--inner.mode fast|slow" in capsys.readouterr().out


@dataclass
class Documented:
    logits: str | None = None  # the directory; None: beside the corpus, computed when absent or
    # written by another teacher. A named one must hold its logits.
    actors: int = 1  # actors scoring the corpus (at most 8)
    # A section of the fields below, not a continuation: the field above ends its sentence.
    seed: int = 0  # where the draws start
    # The noise (used without a corpus): each digit replaced with probability label_noise, and
    label_noise: float = 0.3


def test_field_docs_keep_a_comment_continued_on_the_next_line():
    assert field_docs(Documented) == {
        "logits": "the directory; None: beside the corpus, computed when absent or written by another teacher. A "
                  "named one must hold its logits.",
        "actors": "actors scoring the corpus (at most 8)",
        "seed": "where the draws start",
        "label_noise": "The noise (used without a corpus): each digit replaced with probability label_noise, and",
    }


def test_dry_run_prints_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_config(["--dry-run", "--steps", "3"], Outer(), on_dry_run=lambda config: f"would run {config.steps}")
    assert exit.value.code == 0 and "would run 3" in capsys.readouterr().out


def test_peek_reads_a_field_before_the_parse(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("stage: 2\n")
    assert peek(["--config", str(path)], "stage", 0) == 2
    assert peek(["--config", str(path), "--stage", "1"], "stage", 0) == 1
    assert peek([], "stage", 0) == 0


def test_none_is_a_word_for_a_string_field_and_empty_for_an_optional_one():
    """`--model.memory none` is the no-memory baseline; `--model.init_from none` clears an optional path."""
    config = parse_config(["--model.memory", "none", "--model.init_from", "none"], StageConfig())
    assert config.model.memory == "none" and config.model.init_from is None


@dataclass(frozen=True)
class Reading:
    top_k: int = 0  # chunks each query reads
    scale: float = 1.0


@dataclass
class Section:
    reading: Reading = inline(Reading, "read_")
    read_grad: bool = False  # its own field, though it shares the prefix
    steps: int = 10


@dataclass
class WithInline:
    model: Section = field(default_factory=Section)

    def problems(self) -> list[str]:
        return []


def test_an_inline_field_reads_as_its_sections_own_flags_files_and_dicts(capsys, tmp_path):
    """`inline`: one typed value inside the code, flat prefixed names outside (flags, --help, files, to_dict)."""
    config = parse_config(["--model.read_top_k", "4", "--model.read_grad", "true"], WithInline())
    assert config.model.reading == Reading(top_k=4) and config.model.read_grad is True
    assert to_dict(config) == {"model": {"read_top_k": 4, "read_scale": 1.0, "read_grad": True, "steps": 10}}
    assert from_typed_dict(WithInline, to_dict(config)) == config
    assert from_typed_dict(WithInline, {"model": {"reading": {"top_k": 2}}}).model.reading.top_k == 2  # asdict's form
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  read_scale: 0.5\n")
    assert parse_config(["--config", str(path)], WithInline()).model.reading == Reading(scale=0.5)
    with pytest.raises(SystemExit):
        parse_config(["--help"], WithInline())
    shown = capsys.readouterr().out
    assert "--model.read_top_k" in shown and "chunks each query reads" in shown and "--model.reading" not in shown
    with pytest.raises(SystemExit) as exit:
        parse_config(["--model.read_topk", "1"], WithInline())
    assert exit.value.code == 2
    assert "did you mean --model.read_top_k?" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="did you mean --model.read_scale"):
        from_typed_dict(WithInline, {"model": {"read_scal": 1.0}})
