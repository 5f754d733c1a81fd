"""YAML and `--set` overrides into a validated Config; every mistake becomes one `ConfigError` line
that names the dotted key (unknown keys get a suggestion, msgspec's errors are reworded)."""

import difflib
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from .fields import _all_keys, _fields, _is_section, _render_type, _union_args
from .schema import REMOVED, RENAMED, Config, ConfigError
from .validate import validate


def _unknown_key(cls: type, parts: list[str], key: str) -> ConfigError:
    dotted = ".".join([*parts, str(key)])
    if dotted in RENAMED:
        return ConfigError(dotted, f"renamed to {RENAMED[dotted]}")
    if dotted in REMOVED:
        return ConfigError(dotted, f"removed: {REMOVED[dotted]}")
    names = list(_fields(cls))
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    if close:
        hint = ".".join([*parts, close[0]])
    else:  # right name, wrong section? e.g. trainer.temperature -> rollout.temperature
        keys = _all_keys()
        hint = next((k for k in keys if k.rsplit(".", 1)[-1] == key), None)
        hint = hint or next(iter(difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)), None)
    return ConfigError(dotted, f"unknown key (did you mean {hint}?)" if hint else "unknown key")


_FLOAT_RE = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _coerce(value: Any, tp: Any, raw_text: str | None) -> Any:
    """Fix YAML's surprises before msgspec sees the value: `1e-3` is a string in YAML 1.1; on the
    command line (`raw_text` given) `--set model.path=123` means the string "123"."""
    allowed = _union_args(tp)
    if isinstance(value, str) and float in allowed and str not in allowed and _FLOAT_RE.match(value):
        return float(value)
    if raw_text is None:
        return value
    if str in allowed and isinstance(value, int | float) and type(value) not in allowed:
        return raw_text  # bool is an int subclass, so `--set model.path=yes` also stays "yes"
    if isinstance(value, str) and any(typing.get_origin(a) is list for a in allowed):
        return [value]  # --set engines.urls=http://a
    return value


def _check(raw: dict[str, Any], cls: type, parts: list[str]) -> dict[str, Any]:
    """Reject unknown keys (with a suggestion) and coerce values, recursing into sections."""
    fields = _fields(cls)
    out = {}
    for key, value in raw.items():
        if key not in fields:
            raise _unknown_key(cls, parts, key)
        f = fields[key]
        if _is_section(f.type) and (value is None or isinstance(value, dict)):
            value = _check(value or {}, f.type, [*parts, key])  # an empty `section:` means defaults
        elif not _is_section(f.type):
            value = _coerce(value, f.type, None)
        out[key] = value
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item}", "expected key=value, e.g. --set rollout.temperature=0.7")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(key, f"invalid value {text!r}: {getattr(e, 'problem', e)}") from None
    parts = key.split(".")
    cls: type = Config
    node = raw
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            raise _unknown_key(cls, parts[:i], part)
        f = fields[part]
        if i == len(parts) - 1:
            node[part] = value if _is_section(f.type) else _coerce(value, f.type, text.strip())
            return
        if not _is_section(f.type):
            raise ConfigError(".".join(parts[: i + 1]), f"is a value, not a section; cannot set {key}")
        child = node.get(part)
        node[part] = child = child if isinstance(child, dict) else {}
        node, cls = child, f.type


# --------------------------------------------------------------------------------- msgspec errors


def _lookup(raw: Any, path: str) -> tuple[bool, Any]:
    node = raw
    for tok in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        key, idx = tok
        try:
            node = node[key] if key else node[int(idx)]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def _field_type(path: str) -> Any:
    cls: Any = Config
    tp: Any = None
    for key in path.strip(".").split("."):
        if not _is_section(cls) or key not in (fields := _fields(cls)):
            return None
        tp = cls = fields[key].type
    return tp


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else msgspec.json.encode(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."


def _translate(err: msgspec.ValidationError, raw: dict[str, Any]) -> ConfigError:
    msg, _, path = str(err).partition(" - at `$")
    path = path.rstrip("`")
    key = re.sub(r"^\.", "", path) or "<root>"
    found, value = _lookup(raw, path)
    tp = _field_type(path) if "[" not in path else None
    got = f", got {_show(value)}" if found else ""
    literals = [a for a in _union_args(tp) if typing.get_origin(a) is Literal] if tp is not None else []
    if literals:
        options = ", ".join(repr(v) for a in literals for v in typing.get_args(a))
        nullable = " or null" if type(None) in _union_args(tp) else ""
        return ConfigError(key, f"expected one of {options}{nullable}{got}")
    if _is_section(tp):
        return ConfigError(key, f"expected a mapping of {key} settings{got}")
    m = re.match(r"Expected `([^`]+)`(.*?)(?:, got `[^`]+`)?$", msg)
    if m:
        expected = _render_type(tp) if tp is not None and "[" not in path and not m.group(2) else m.group(1)
        return ConfigError(key, f"expected {expected}{m.group(2)}{got}")
    return ConfigError(key, (msg[:1].lower() + msg[1:]).replace("`", ""))


def config_from_dict(raw: dict[str, Any], *, check_paths: bool = True) -> Config:
    """Build and validate a Config from plain data (e.g. a parsed YAML mapping)."""
    raw = _check(raw, Config, [])
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise _translate(e, raw) from None
    validate(cfg, check_paths=check_paths)
    return cfg


def load_config(path: str | None, overrides: Sequence[str] = (), *, check_paths: bool = True) -> Config:
    """Load `path` (YAML; None or an empty file = defaults), apply `--set a.b=value` overrides, validate.

    `check_paths=False` skips the rules that look at the filesystem (model folder, data file).
    """
    raw: Any = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(path, "no such file")
        if p.is_dir():
            raise ConfigError(path, "is a folder, expected a YAML file")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(path, f"invalid YAML{where}: {getattr(e, 'problem', None) or e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(path, f"expected a mapping of sections at top level, got {type(raw).__name__}")
    raw = _check(raw, Config, [])
    for item in overrides:
        _apply_override(raw, item)
    return config_from_dict(raw, check_paths=check_paths)


def dump_config(cfg: Config, path: Path | None = None) -> str:
    """YAML for `cfg`; `load_config` of it gives back an equal Config. With `path`, also written there
    (its folder made if missing)."""
    text = yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False, default_flow_style=False)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return text
