"""One command line for every job: a typed config dataclass, overridden by `--config FILE` (YAML or JSON), then by
`--section.field VALUE` flags (a list field takes several values: `--data.variants hinted imperative`); then
validated. Every problem is one line on stderr and exit status 2, never a traceback: a job's user fixes a flag, not
our code. Field docs are the dataclasses' trailing `# comments`, read from their source for `--help`.

Our own parser rather than jsonargparse: its errors print the usage block and can span lines, our docs are comments
(it reads docstrings), and the mechanism below is the whole of what the jobs need, without a dependency."""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import inspect
import io
import sys
import tokenize
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

import yaml

NONE = ("none", "null")
INLINE = "inline_prefix"  # field metadata of a nested config read as its section's own fields (see `inline`)


def inline(cls, prefix: str):
    """A field holding the config dataclass `cls` whose fields read as the section's own, each name prefixed: flags,
    config files, MLflow params and `to_dict` say `model.memory_top_k` for `ModelConfig.reading.top_k`. The value
    stays one typed object inside the code, the names its users know stay flat outside."""
    return dataclasses.field(default_factory=cls, metadata={INLINE: prefix})


class ConfigError(ValueError):
    """A problem a job's user fixes on the command line: shown as one line, exit status 2."""


def parse_config(argv: list[str] | None, default, description: str = "", *,
                 on_dry_run: Callable[[Any], str] | None = None):
    """default < --config FILE < --section.field VALUE; then `default`'s problems(). With `on_dry_run`, the job
    takes --dry-run: print on_dry_run(config) and exit 0 instead of returning."""
    parser = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                     usage="%(prog)s [--config FILE] [--section.field VALUE ...]")
    parser.add_argument("--config", metavar="FILE", help="a YAML or JSON file with any of the sections below")
    if on_dry_run:
        parser.add_argument("--dry-run", action="store_true",
                            help="validate, print the resolved config and the memory plan, and exit without Ray")
    leaves = schema(type(default))
    defaults = to_dict(default)
    groups: dict[str, Any] = {}
    for key, (hint, doc, section_doc) in leaves.items():
        section = key.rpartition(".")[0]
        if section and section not in groups:
            groups[section] = parser.add_argument_group(section, section_doc or None)
        value = _get_plain(defaults, key, None)
        shape = ({"nargs": "+"} if _list_item(hint) is not None else
                 {"nargs": "?", "const": "true"} if bool in _options(hint) else {})  # a bare bool flag sets it
        (groups[section] if section else parser).add_argument(
            f"--{key}", default=None, metavar=_metavar(hint), **shape,
            help=f"{doc.rstrip('.') + '. ' if doc else ''}default: {_show(value)}".replace("%", "%%"))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(_unknown(unknown[0], ["config", "dry-run", *leaves]))
    args = vars(args)
    try:
        data = to_dict(default)
        if args.get("config"):
            path = Path(args["config"])
            if not path.is_file():
                raise ConfigError(f"--config {path}: no such file")
            _merge(data, yaml.safe_load(path.read_text()) or {}, "")
        for key in leaves:
            if args.get(key) is not None:
                _set(data, key, args[key])
        config = from_typed_dict(type(default), data)
    except ConfigError as error:
        parser.error(str(error))
    problems = config.problems()
    if problems:
        for problem in problems:
            print(f"{parser.prog}: {problem}", file=sys.stderr)
        sys.exit(2)
    if on_dry_run and args.get("dry_run"):
        print(on_dry_run(config), flush=True)
        sys.exit(0)
    return config


def peek(argv: list[str] | None, key: str, default: Any) -> Any:
    """One field's value before the full parse, from --key VALUE or the --config file: what picks a job's preset."""
    argv = sys.argv[1:] if argv is None else argv
    value = default
    for flag, following in zip(argv, argv[1:]):
        if flag == "--config" and Path(following).is_file():
            value = _get_plain(yaml.safe_load(Path(following).read_text()) or {}, key, value)
    for flag, following in zip(argv, argv[1:]):
        if flag == f"--{key}":
            value = yaml.safe_load(following)
    return value


def schema(cls, prefix: str = "", section_doc: str = "") -> dict[str, tuple[Any, str, str]]:
    """{'train.lr': (float, its doc, the section's doc)} for every leaf field of a (nested) config dataclass."""
    hints = typing.get_type_hints(cls)
    docs = {k: v for base in reversed(cls.__mro__) if dataclasses.is_dataclass(base)
            for k, v in field_docs(base).items() if v}  # a subclass's undocumented default keeps its base's doc
    out = {}
    for f in fields(cls):
        hint = hints[f.name]
        if INLINE in f.metadata:
            out |= schema(hint, prefix + f.metadata[INLINE], section_doc)
        elif dataclasses.is_dataclass(hint):
            written = hint.__doc__ and not hint.__doc__.startswith(hint.__name__ + "(")  # not dataclass's own
            out |= schema(hint, f"{prefix}{f.name}.", inspect.getdoc(hint) if written else "")
        else:
            out[f"{prefix}{f.name}"] = (hint, docs.get(f.name, ""), section_doc)
    return out


def field_docs(cls) -> dict[str, str]:
    """A dataclass's own field docs: the `# comment` trailing each field (with the comment lines that continue it),
    or the comment lines right above it."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments = {t.start[0]: t.string.lstrip("# ").strip() for t in
                tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    lines = source.splitlines()
    own_line = {n for n in comments if lines[n - 1].lstrip().startswith("#")}
    fields_ = [node for node in ast.parse(source).body[0].body
               if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]
    docs = {}
    for node, following in zip(fields_, [*fields_[1:], None]):
        if node.end_lineno in comments and node.end_lineno not in own_line:
            docs[node.target.id] = " ".join([comments[node.end_lineno], *_continuation(node, following, comments,
                                                                                         own_line)])
            continue
        above, at = [], node.lineno - 1
        while at in own_line:
            above.insert(0, comments[at])
            at -= 1
        docs[node.target.id] = " ".join(above)
    return docs


def _continuation(node, following, comments: dict[int, str], own_line: set[int]) -> list[str]:
    """The comment lines under a field's trailing comment that finish its sentence: the comment stops mid-sentence
    and the next field has its own trailing comment (else those lines are the next field's doc, or a section's)."""
    block, at = [], node.end_lineno + 1
    while at in own_line:
        block.append(comments[at])
        at += 1
    mid_sentence = comments[node.end_lineno][-1:].isalnum() or comments[node.end_lineno].endswith(",")
    next_has_own = following is not None and following.end_lineno in comments and following.end_lineno not in own_line
    return block if block and mid_sentence and next_has_own else []


def to_dict(config) -> dict[str, Any]:
    """A (nested) config dataclass as plain data, like dataclasses.asdict, with `inline` fields' values under their
    prefixed names: the form flags, config files and MLflow params name."""
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            nested = to_dict(value)
            out |= {f.metadata[INLINE] + k: v for k, v in nested.items()} if INLINE in f.metadata else {f.name: nested}
        else:
            out[f.name] = copy.deepcopy(value)
    return out


def from_typed_dict(cls, data: dict[str, Any], prefix: str = ""):
    """A (nested) config dataclass from plain data, coercing each value to its field's type; unknown keys fail.
    An `inline` field takes its values from the prefixed names (or, as dataclasses.asdict writes it, its own)."""
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    inlined = {f.name: (f.metadata[INLINE], [g.name for g in fields(hints[f.name])]) for f in fields(cls)
               if INLINE in f.metadata}
    data = dict(data)
    for key in list(data):
        owner = next((name for name, (pre, names) in inlined.items()
                      if key.startswith(pre) and key[len(pre):] in names), None)
        if owner is not None and key not in known:
            data[owner] = {**(data.get(owner) or {}), key[len(inlined[owner][0]):]: data.pop(key)}
        elif key not in known:
            flags = [k for k in known if k not in inlined] + [pre + n for pre, names in inlined.values() for n in names]
            raise ConfigError(_unknown(prefix + key, [prefix + k for k in flags]))
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        hint, value = hints[f.name], data[f.name]
        if f.name in inlined:
            kwargs[f.name] = from_typed_dict(hint, value or {}, prefix + inlined[f.name][0])
        elif dataclasses.is_dataclass(hint):
            kwargs[f.name] = from_typed_dict(hint, value or {}, f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = _coerce(value, hint, f"{prefix}{f.name}")
    return cls(**kwargs)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def _unknown(flag: str, known: list[str]) -> str:
    name = flag.split("=")[0].lstrip("-")
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f"; did you mean --{close[0]}?" if close else "; see --help for the known keys"
    return f"unknown config key {name!r}{hint}" if flag.startswith("--") or "." in flag else \
        f"unexpected argument {flag!r}: every value follows a --section.field flag{hint}"


def _merge(data: dict[str, Any], updates: dict[str, Any], prefix: str) -> None:
    if not isinstance(updates, dict):
        raise ConfigError(f"--config: {prefix or 'the file'} must be a mapping of sections")
    for key, value in updates.items():
        if key not in data:
            raise ConfigError(_unknown(prefix + key, [prefix + k for k in data]))
        if isinstance(data[key], dict):
            _merge(data[key], value, f"{prefix}{key}.")
        else:
            data[key] = value


def _set(data: dict[str, Any], dotted: str, raw: str | list[str]) -> None:
    *sections, name = dotted.split(".")
    for section in sections:
        data = data[section]
    if isinstance(raw, list):  # a list field: `--data.variants a b`, `--data.variants none`, or a YAML `[a, b]`
        parsed = [_yaml(item) for item in raw]
        data[name] = None if parsed == [None] else parsed[0] if len(parsed) == 1 and isinstance(parsed[0], list) \
            else parsed
    else:
        data[name] = _yaml(raw)


def _yaml(raw: str) -> Any:
    if raw.lower() in NONE:
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _get_plain(data: dict, dotted: str, default: Any) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return default
        data = data[part]
    return data


def _options(hint: Any) -> tuple:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)


def _list_item(hint: Any) -> Any:
    """The item type of a list (or tuple[X, ...]) field, else None."""
    for option in _options(hint):
        if typing.get_origin(option) in (list, tuple):
            return typing.get_args(option)[0]
    return None


def _choices(hint: Any) -> tuple[str, ...]:
    """The values a Literal field (or list item) accepts, () for any other type."""
    return tuple(choice for option in _options(hint) if typing.get_origin(option) is typing.Literal
                 for choice in typing.get_args(option))


def _metavar(hint: Any) -> str:
    """A field's value as --help shows it: its choices (gca|cross|merged), else its type (INT, FLOAT|NONE...)."""
    item = _list_item(hint)
    choices = _choices(item or hint)
    if choices:
        return "|".join(choices)
    names = [o.__name__ for o in _options(item or hint) if o is not type(None)]
    return "|".join(names).upper()


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "(empty)"
    return str(value)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    options = _options(hint)
    if value is None:
        if type(None) in options:
            return None
        if str in options or "none" in _choices(hint):
            return "none"  # `--model.memory none` names the no-memory baseline: a word, not an empty value
        raise ConfigError(f"{name} cannot be empty: give it a {_metavar(hint).lower()}")
    item = _list_item(hint)
    if item is not None:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} is a list: --{name} A B C (or a YAML list in --config), got {value!r}")
        items = [_coerce(v, item, name) for v in value]
        return tuple(items) if tuple in [typing.get_origin(o) for o in options] else items
    choices = _choices(hint)
    if choices:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool) and str(value) in choices:
            return str(value)
        raise ConfigError(f"{name} must be one of {choices}, got {value!r}: e.g. --{name} {choices[0]}")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)  # YAML reads 3e-4 as a string
            except ValueError:
                continue
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is bool and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if option is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{name} expects {_metavar(hint).lower()}, got {value!r}: e.g. --{name} {_example(hint)}")


def _example(hint: Any) -> str:
    kinds = _options(hint)
    return "8" if int in kinds else "0.5" if float in kinds else "true" if bool in kinds else "VALUE"
