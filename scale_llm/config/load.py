"""Loading a config: YAML (with `base:`), dotted `--set` overrides, typing every value against
the tree, and writing it back. Precedence: CLI overrides > YAML > defaults. Every problem is
collected into one `UserError` naming each key and the fix, before any model or process group."""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import logging
import math
import os
import re
import types
import typing
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any, Literal

import yaml

from scale_llm.config.data import PER_SOURCE_KEYS
from scale_llm.config.fp8 import WRONG_VALUES
from scale_llm.config.sections import Config, get_key
from scale_llm.config.validate import PATH_KEYS, format_errors, path_value, validate
from scale_llm.errors import UserError, short

log = logging.getLogger(__name__)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at `path` (if any), then `key.path=value` overrides."""
    raw = {} if path is None else read_yaml_with_base(Path(path))
    where = "defaults" if path is None else str(path)
    errors: list[str] = []
    for item in overrides or []:
        _apply_override(raw, item, errors)
    if overrides:
        where += " + command-line overrides"
    _move_deprecated_keys(raw, errors)
    cfg = expand_home(build_section(Config, raw, "", errors))
    # Check values too, skipping messages about keys that already failed (they hold defaults).
    failed = [msg.split(":", 1)[0] for msg in errors]
    errors.extend(m for m in validate(cfg) if not any(_mentions(m, k) for k in failed))
    errors += [  # (a bound of the key's own said first; 1e20 printed is no YAML file's integer)
        f"{key}={value} is past the 64-bit integers a key takes; give a smaller number"
        for key, value in _past_64_bits(cfg)
        if not any(_mentions(m, key) for m in errors)
    ]
    if errors:
        raise UserError(format_errors(errors, where))
    return cfg


def _past_64_bits(section: Any, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(key, value) of each integer setting at 2^63 or past it (`--set x=1e20` makes one)."""
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if dataclasses.is_dataclass(value):
            yield from _past_64_bits(value, f"{prefix}{field.name}.")
        elif isinstance(value, list):
            for i, entry in enumerate(value):
                if dataclasses.is_dataclass(entry):
                    yield from _past_64_bits(entry, f"{prefix}{field.name}[{i}].")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            yield f"{prefix}{field.name}", value


def _mentions(message: str, key: str) -> bool:
    """Whether `message` names dotted `key` itself (eval.tasks, not eval.tasks_limit)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message) is not None


MAX_CONFIG_BYTES = 1_000_000  # the shipped configs are ~2 KB
MAX_CONFIG_VALUES = 10_000  # scalars + containers after expanding YAML aliases (~150 in 7b.yaml)
MAX_CONFIG_DEPTH = 20  # nesting levels (parallel.deepspeed.config's entries are the deepest)


def shipped_config_dir() -> Path | None:
    """The shipped configs: an installed wheel's scale_llm/configs, or the checkout's yaml/."""
    here = Path(__file__)
    for candidate in (here.parents[1] / "configs", here.resolve().parents[2] / "yaml"):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    return None


def resolve_config_path(
    path: str | Path, beside: Path = Path(), including: Path | None = None
) -> Path:
    """A config path (relative to `beside`); a bare name (`tiny`, `7b.yaml`) is also looked up
    as NAME.yaml there, then among the shipped configs: a file of the user's wins, but not the
    file `including` it (a tiny.yaml with `base: tiny` extends the shipped one)."""
    p = beside / path
    if len(Path(path).parts) != 1 or str(path).startswith("."):  # (./tiny.yaml: a path)
        return p
    shipped = shipped_config_dir()
    folders = (beside, shipped) if shipped else (beside,)
    names = (p.name, p.name + ".yaml")
    found = (d / n for d in folders for n in names if (d / n).is_file())
    return next((f for f in found if including is None or not _same_file(f, including)), p)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:  # (one gone meanwhile)
        return False


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = resolve_config_path(path)
    if not p.is_file():
        from scale_llm.files import describe_kind

        kind = describe_kind(p)
        shipped = shipped_config_dir()
        names = ", ".join(sorted(q.stem for q in shipped.glob("*.yaml"))) if shipped else ""
        raise UserError(
            f"config file {p} {'does not exist' if kind == 'missing' else 'is ' + kind}; pass the "
            f"path of a YAML file or a shipped config's name."
            + (f" Shipped configs (by name): {names}." if names else "")
        )
    if (size := p.stat().st_size) > MAX_CONFIG_BYTES:
        raise UserError(
            f"config file {p} is {size:,} bytes; a config is a few KB of YAML (limit "
            f"{MAX_CONFIG_BYTES:,}): is this the right file?"
        )
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        text = "\0"
    if "\0" in text:
        raise UserError(f"config file {p} is not UTF-8 text (a binary file?); pass a YAML config")
    try:
        _check_yaml_shape(text, f"config file {p}")
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"config file {p} is not valid YAML: {e}") from None
    except ValueError as e:  # an integer past Python's digit limit
        raise UserError(f"config file {p} holds a value no key takes ({e}); fix it") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"config file {p} must hold a mapping of sections (run:, model:, ...), "
            f"not a {type(data).__name__}"
        )
    _empty_sections_as_mappings(data, Config)
    return data


def _empty_sections_as_mappings(raw: dict[str, Any], cls: type) -> None:
    """A section with no keys (all commented out) is YAML null: read it as empty."""
    hints = typing.get_type_hints(cls)
    for name in raw.keys() & hints.keys():
        if dataclasses.is_dataclass(hints[name]):
            if raw[name] is None:
                raw[name] = {}
            elif isinstance(raw[name], dict):
                _empty_sections_as_mappings(raw[name], hints[name])


def _check_yaml_shape(text: str, where: str) -> None:
    """Refuse alias bombs, recursive aliases and absurd nesting before anything expands them:
    count the values on the composed node graph (aliases are shared nodes there: linear in the
    file). `where`: what messages call the text."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise UserError(
            f"{where} nests too deeply to read; a config is a few levels of sections and keys"
        ) from None
    if root is None:
        return
    sizes: dict[int, int] = {}

    def expanded(node: yaml.Node, depth: int) -> int:
        if depth > MAX_CONFIG_DEPTH:
            raise UserError(
                f"{where} nests deeper than {MAX_CONFIG_DEPTH} levels; a config is "
                f"a few levels of sections and keys"
            )
        if id(node) not in sizes:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
            if isinstance(node, yaml.MappingNode):
                children = [child for pair in node.value for child in pair]
            sizes[id(node)] = 1 + sum(expanded(c, depth + 1) for c in children)
            if sizes[id(node)] > MAX_CONFIG_VALUES:
                raise UserError(
                    f"{where} expands to more than {MAX_CONFIG_VALUES:,} values (YAML "
                    f"aliases repeating aliases?); a config has a few hundred at most"
                )
        return sizes[id(node)]

    expanded(root, 0)
    _refuse_surprises(root, where)  # (a walk the limits above keep short)


def _refuse_surprises(root: yaml.Node, where: str) -> None:
    """A key written twice in one mapping (PyYAML keeps the last) is an error naming both lines;
    so is a number YAML 1.1 reads unlike its text (`010` as octal 8, `1:30` as 90), one past
    64 bits (`0x` and `0b` numbers escape Python's digit limit) and a value its tag does not
    take (`!!bool maybe`)."""
    todo: list[tuple[yaml.Node, str]] = [(root, "")]
    while todo:
        node, prefix = todo.pop()
        if isinstance(node, yaml.ScalarNode):
            _refuse_odd_scalar(node, prefix, where)
        if isinstance(node, yaml.SequenceNode):
            todo.extend((child, prefix) for child in node.value)
        seen: dict[tuple[str, str], int] = {}
        for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (first := seen.get((key.tag, key.value))) is not None:
                    lines = f"line {line}" if first == line else f"lines {first} and {line}"
                    raise UserError(
                        f"{where}: {prefix}{key.value} is written twice ({lines}); YAML "
                        f"would silently keep only the last, so merge the two into one"
                    )
                seen[(key.tag, key.value)] = line
                todo.append((value, f"{prefix}{key.value}."))
            else:
                todo.append((value, prefix))


def _refuse_odd_scalar(node: yaml.ScalarNode, prefix: str, where: str) -> None:
    key, text = (prefix.rstrip(".") + ": " if prefix else ""), node.value
    quote = f"quote it ('{text}') where the key takes a string"
    if node.tag.endswith(":int") and re.fullmatch(r"[-+]?0[0-7_]+", text):
        raise UserError(
            f"{where}: {key}{text} reads as the octal number {int(text.replace('_', ''), 8)} "
            f"in YAML; write it without the leading zero, or {quote}"
        )
    if node.tag.endswith((":int", ":float")) and ":" in text:
        raise UserError(
            f"{where}: {key}{text} reads as a base-60 number in YAML ({short(text)} is "
            f"{yaml.SafeLoader('').construct_object(node)}); write the number, or {quote}"
        )
    if not node.tag.startswith("tag:yaml.org,2002:"):
        return  # (a tag no safe loader takes: safe_load names it)
    try:
        value = yaml.SafeLoader("").construct_object(node)
    except (yaml.YAMLError, ValueError):  # (past Python's digit limit: said where it is read)
        return
    except (KeyError, IndexError, AttributeError, TypeError):
        tag = node.tag.rsplit(":", 1)[-1]
        raise UserError(
            f"{where}: {key}!!{tag} {short(text)} is no value YAML's {tag} tag takes; remove "
            f"the tag or give such a value"
        ) from None
    if isinstance(value, int) and abs(value) >= 2**63:
        raise UserError(
            f"{where}: {key}{short(text)} is past the 64-bit integers a key takes; give a "
            f"smaller number"
        )


def read_yaml_with_base(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML file, merged over the file its optional top-level `base:` names (relative to it)."""
    raw = read_yaml(path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise UserError(
            f"{path}: base must be the path of another YAML file, not {str(base)[:60]!r}"
        )
    path = resolve_config_path(path)
    try:  # (relative to the file itself: a symlink's target's folder, as for a nested base)
        base_path = resolve_config_path(os.path.expanduser(base), path.resolve().parent, path)
        base_path = base_path.resolve()
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a NUL, a long name
        raise UserError(
            f"{path}: base: {short(base)} is no path to a YAML file ({e}); give the path of "
            f"one (relative to {path.name}) or a shipped config's name"
        ) from None
    if base_path in seen:
        raise UserError(f"{path}: base: {base} leads back to itself; remove the cycle")
    if not base_path.is_file():
        try:
            read_yaml(base_path)  # (its message: what is there, and the shipped names)
        except UserError as e:
            raise UserError(f"{path}: base: {short(base)}: {e}") from None
    return deep_merge(read_yaml_with_base(base_path, (*seen, path.resolve())), raw)


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, section by section (neither is modified)."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if both else value
    return out


INDEXED = re.compile(r"([^\[\]]+)\[(\d+)\]")  # `sources[0]`: an entry of a list key
WHOLE_LIST = "[{name: ..., source: ..., weight: ...}, ...]"


def _apply_override(raw: dict[str, Any], item: str, errors: list[str]) -> None:
    """Set one dotted key (`a.b=value`, the value a YAML scalar; `data.sources[0].weight=3`
    reaches into a list's entry) in the raw tree. A step that cannot be taken is one error."""
    key, sep, text = item.partition("=")
    if not sep or not (key := key.strip()):
        raise UserError(
            f"override {short(item)} must look like section.key=value, e.g. --set train.lr=3e-4"
        )
    if not text.strip():  # (an unset shell variable: never a quiet null, nor a default)
        errors.append(
            f"{key}: --set {short(item)} gives no value (an unset shell variable?); give one"
        )
        return
    try:
        _check_yaml_shape(text, f"--set {short(item)}")  # (a recursive alias among them)
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = text
    except ValueError as e:  # an integer past Python's digit limit
        errors.append(f"{key}: --set {short(item)} gives no value the key takes ({e})")
        return
    if value is None and text.strip() not in ("null", "Null", "NULL", "~"):
        errors.append(  # (`#run1`: a YAML comment, read as nothing)
            f"{key}: --set {short(item)} reads as null in YAML; quote the value "
            f"(--set '{key}=\"{text.strip()}\"'), or give null for none"
        )
        return
    parts = key.split(".")
    node: Any = raw
    cls: Any = Config  # the schema of `node`; None below a key it does not know (_build says so)
    for i in range(len(parts)):
        step = _override_step(node, cls, parts, i, text)
        if isinstance(step, str):
            errors.append(step)
            return
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        holder, name, cls = step
        hint = hints.get(name)  # (a section, or a mapping key such as parallel.deepspeed.config)
        mapping = cls is not None or dict in (hint, *typing.get_args(hint))
        if i == len(parts) - 1:
            # a section given as a mapping is merged key by key, as `base:` merges it
            section = dataclasses.is_dataclass(cls) and isinstance(holder, dict)
            if section and isinstance(value, dict) and isinstance(holder.get(name, {}), dict):
                value = deep_merge(holder.get(name, {}), value)
            holder[name] = value
            return
        if isinstance(holder, dict) and (name not in holder or mapping and holder[name] is None):
            holder[name] = {}  # (or a section or mapping written null, as `config` prints one)
        node = holder[name]
        if not isinstance(node, dict):
            errors.append(
                f"{'.'.join(parts[: i + 1])}: is a value, not a section; cannot set {key}"
            )
            return


def override_setting(overrides: list[str], key: str) -> str | None:
    """The first `--set` item that sets dotted `key`, itself or as part of a section given
    whole (`--set 'train={max_steps: 3}'`); None if none does."""
    head, _, last = key.rpartition(".")
    for item in overrides:
        raw: dict[str, Any] = {}
        _apply_override(raw, item, [])
        for part in head.split(".") if head else ():
            raw = raw.get(part) if isinstance(raw.get(part), dict) else {}
        if last in raw:
            return item
    return None


def _override_step(
    node: dict[str, Any], cls: Any, parts: list[str], i: int, text: str
) -> tuple[Any, Any, Any] | str:
    """Where parts[i] of an override lives: (the dict or list holding it, its key or index, the
    schema below it), or the message that says why it cannot be set."""
    part, key, at = parts[i], ".".join(parts), ".".join(parts[: i + 1])
    if cls is None:
        return node, part, None  # below an unknown key, which _build names
    hints = typing.get_type_hints(cls)
    indexed = INDEXED.fullmatch(part)
    name, above = indexed.group(1) if indexed else part, at[: len(at) - len(part)]
    if not indexed and ("[" in part or "]" in part):
        fixed = ".".join([*parts[:i], part.split("[")[0] + "[0]", *parts[i + 1 :]])
        return (
            f"{key}: {part!r} is not KEY[INDEX]; an index is a whole number from 0, e.g. "
            f"--set '{fixed}={text}'"
        )
    if name not in hints:
        if indexed:
            return _unknown_key_message(above + name, name, list(hints), above)
        return node, part, None  # (_build names the unknown key, with a did-you-mean)
    tp = hints[name]
    if typing.get_origin(tp) is not list:
        if indexed:
            plain = ".".join([*parts[:i], name, *parts[i + 1 :]])
            return (
                f"{key}: {above}{name} is not a list, so it takes no [index]; --set {plain}={text}"
            )
        return node, name, tp if dataclasses.is_dataclass(tp) else None
    if indexed:
        entry = typing.get_args(tp)[0]
        return _list_entry(node.get(name), int(indexed.group(2)), key, above + name, entry)
    if i + 1 < len(parts):
        return _list_step_problem(key, at, parts[i + 1 :], text)
    return node, name, None


def _list_step_problem(key: str, listed: str, after: list[str], text: str) -> str:
    """`data.sources.0.weight` or `data.sources.weight`: an entry's index goes in brackets."""
    if after[0].isascii() and after[0].isdigit():
        fixed = ".".join([f"{listed}[{after[0]}]", *after[1:]])
        return f"{key}: an entry of a list is written {listed}[{after[0]}]; --set '{fixed}={text}'"
    fixed = ".".join([f"{listed}[0]", *after])
    return (
        f"{key}: {listed} is a list of entries; set a key of one entry by its index from 0 "
        f"(--set '{fixed}={text}'), or give the whole list (--set '{listed}={WHOLE_LIST}')"
    )


def _list_entry(
    entries: Any, index: int, key: str, listed: str, entry: Any
) -> tuple[list[Any], int, Any] | str:
    """(the list, the index, the entries' schema) of entry `index` of `listed`, or why none."""
    count = len(entries) if isinstance(entries, list) else 0
    if index < count:
        return entries, index, entry
    if count == 0:
        return (
            f"{key}: {listed} has no entries in this config; give the whole list first "
            f"(--set '{listed}={WHOLE_LIST}')"
        )
    held = f"{count} entr{'y' if count == 1 else 'ies'}, {listed}[0] to {listed}[{count - 1}]"
    return (
        f"{key}: {listed} has {held}; use one of those indices, or give the whole list "
        f"(--set '{listed}={WHOLE_LIST}')"
    )


# Keys that moved: old dotted key -> new dotted key. The old one is still read, with a note.
MOVED = {
    "model.activation_checkpointing": "activation_checkpointing.mode",
    "model.activation_checkpointing_k": "activation_checkpointing.k",
}


def _move_deprecated_keys(raw: dict[str, Any], errors: list[str]) -> None:
    """Moved keys to their new place, with a deprecation line; set in both places: an error."""
    for old, new in MOVED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        section = raw.get(old_section)
        if not isinstance(section, dict) or old_key not in section:
            continue
        value = section.pop(old_key)
        target = raw.setdefault(new_section, {})
        if not isinstance(target, dict):
            continue  # reported as a malformed section by _build
        if new_key in target:
            errors.append(
                f"{old}: moved to {new}, and both are set ({short(value)} and "
                f"{short(target[new_key])}); keep only {new}"
            )
            continue
        target[new_key] = value
        log.warning("config: %s is deprecated; use %s (read as %s=%s)", old, new, new, value)


def key_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, Any, Any]]:
    """(dotted key, dataclass field, type) of every key of the tree, in the dataclasses' order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from key_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, hints[f.name]


def all_keys() -> list[str]:
    """Every dotted key of the config tree, e.g. ['run.name', ..., 'parallel.backend']."""
    return [key for key, _, _ in key_fields()]


def run_defining_keys() -> list[str]:
    """Dotted keys marked `run_defining` in the schema: a checkpoint resumes only if they match."""
    return [key for key, f, _ in key_fields() if f.metadata.get("run_defining")]


def with_changes(cfg: Any, changes: dict[str, Any]) -> Any:
    """A copy of a config (or of a section) with dotted keys replaced (values already typed)."""
    for key, value in changes.items():
        name, _, rest = key.partition(".")
        value = with_changes(getattr(cfg, name), {rest: value}) if rest else value
        cfg = dataclasses.replace(cfg, **{name: value})
    return cfg


def expand_home(cfg: Config) -> Config:
    """`~` and `~user` at the start of a path key, expanded (os.path.expanduser) once, as the
    config is loaded, so every reader and the run dir's config.yaml see the path the run used."""
    changes = {}
    for key in PATH_KEYS:
        if (path := path_value(cfg, key) or "").startswith("~"):
            value = get_key(cfg, key)
            changes[key] = value[: len(value) - len(path)] + os.path.expanduser(path)
    return with_changes(cfg, changes)


def build_section(cls: type, raw: Any, prefix: str, errors: list[str]) -> Any:
    """Instantiate dataclass `cls` from a raw mapping, recording every problem in `errors`."""
    if not isinstance(raw, dict):
        errors.append(f"{prefix.rstrip('.')}: expected a mapping of keys, got {short(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            errors.append(_unknown_key_message(dotted, str(key), list(fields), prefix))
            continue
        if value is None and fields[key].metadata.get("null_unsets"):
            continue  # unset: the default (over a base: file's value)
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_section(tp, value, f"{dotted}.", errors)
        elif typing.get_origin(tp) is list:  # a list of entries, each a section (data.sources)
            entry = typing.get_args(tp)[0]
            if isinstance(value, list):
                kwargs[key] = [
                    build_section(entry, v, f"{dotted}[{i}].", errors) for i, v in enumerate(value)
                ]
            else:
                errors.append(f"{dotted}: expected a list of mappings, got {short(value)}")
        else:
            ok, converted, expected = _coerce(value, tp)
            if ok:
                kwargs[key] = converted
                continue
            if wrong := isinstance(value, Hashable) and WRONG_VALUES.get((dotted, value)):
                expected, wrong = expected.split(" (did you mean")[0], f"; {wrong}"  # another key's
            elif expected.startswith("a string") and isinstance(value, (dict, dt.date)):
                wrong = "; YAML read the text as that: quote it"  # (`Q: what`, 2024-01-01)
            errors.append(f"{dotted}: expected {expected}, got {short(value)}{wrong or ''}")
    return cls(**kwargs)


def _coerce(value: Any, tp: Any) -> tuple[bool, Any, str]:
    """Check `value` against annotation `tp`: (ok, converted value, what was expected)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        choices = " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
        if any(type(a) is type(value) and a == value for a in args):  # (1 is not true)
            return True, value, f"one of {choices}"
        near = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        return False, value, f"one of {choices}" + (f" (did you mean {near[0]}?)" if near else "")
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return True, None, ""
        ok, converted, expected = _coerce(value, next(a for a in args if a is not type(None)))
        return ok, converted, f"{expected} or null"
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value, "an integer"
        number = _as_float(value)  # (1e3; past 2^63: `_past_64_bits`)
        whole = number is not None and number.is_integer()
        return whole, int(number) if whole else value, "an integer"
    if tp is float:
        if (number := _as_float(value)) is not None and math.isfinite(number):
            return True, number, "a number"
        return False, value, "a finite number"
    if tp is dict and isinstance(value, dict):  # (a pass-through: its numbers as JSON reads them)
        return True, _exponent_numbers(value), "a mapping"
    if tp is str and isinstance(value, str):  # (--set passes bytes not UTF-8 as surrogates)
        return _utf8(value), value, "a string of UTF-8 text (re-encode it)"
    simple = {bool: (bool, "true or false"), str: (str, "a string"), dict: (dict, "a mapping")}
    if tp in simple:
        return isinstance(value, simple[tp][0]), value, simple[tp][1]
    raise TypeError(f"unsupported config annotation {tp!r}")


def _utf8(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


# a number in JSON and YAML 1.2 that PyYAML reads as a string: 1e9, 5e-4 (no dot, or no sign)
EXPONENT = re.compile(r"[-+]?(\d[\d_]*\.?\d*|\.\d+)[eE][-+]?\d+")


def _exponent_numbers(value: Any) -> Any:
    """`value` with every string written like 1e9 a number (DeepSpeed's JSON examples read so)."""
    if isinstance(value, dict):
        return {k: _exponent_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_exponent_numbers(v) for v in value]
    if isinstance(value, str) and EXPONENT.fullmatch(value):
        return float(value.replace("_", ""))
    return value


def _as_float(value: Any) -> float | None:
    if isinstance(value, str):  # PyYAML reads 3e-4 (no dot) as a string
        try:
            return float(value.replace("_", ""))
        except ValueError:
            return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unknown_key_message(dotted: str, key: str, names: list[str], prefix: str) -> str:
    kind = "key" if prefix else "section"
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if near:
        return f"{dotted}: unknown {kind}; did you mean {prefix}{near[0]}?"
    elsewhere = [p for p in all_keys() if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"{dotted}: unknown {kind} here; it lives at {elsewhere[0]}"
    return f"{dotted}: unknown {kind}; valid {kind}s here: {', '.join(names)}"


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    """The config as YAML; a mixture's without the one-source keys its entries hold instead."""
    tree = to_dict(cfg)
    for key in PER_SOURCE_KEYS if cfg.data.sources else ():
        del tree["data"][key]
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the config (as the user set it: `auto` stays `auto`; the resolved values go to
    plan.json) atomically; feeding it back to `train` reproduces the run."""
    from scale_llm.files import atomic_write_text

    atomic_write_text(
        path,
        "# scale_llm config as given (defaults filled in); plan.json beside it holds what `auto`\n"
        "# resolved to; `scale-llm train` accepts this file as is\n" + dump_yaml(cfg),
    )
