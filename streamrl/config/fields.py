"""Walking the schema: each field's type, doc and constraints, and `describe_config()` built on them."""

import dataclasses
import functools
import types
import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .schema import Config

_RULES = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >="}


@dataclasses.dataclass(frozen=True)
class _Field:
    type: Any  # the annotation without its outer Annotated
    doc: str
    rule: str  # constraints in words, e.g. ">= 0, <= 1"


@functools.cache
def _fields(cls: type) -> dict[str, _Field]:
    out = {}
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        metas = [m for m in getattr(tp, "__metadata__", ()) if isinstance(m, Meta)]
        inner = tp.__origin__ if typing.get_origin(tp) is Annotated else tp
        metas += [
            m for a in typing.get_args(inner) if typing.get_origin(a) is Annotated for m in a.__metadata__
        ]
        doc = next((m.description for m in metas if m.description), "")
        rule = ", ".join(
            f"{op} {getattr(m, k)}" for m in metas for k, op in _RULES.items() if getattr(m, k) is not None
        )
        out[name] = _Field(inner, doc, rule)
    return out


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _list_item_section(tp: Any) -> type | None:
    """The settings group a `list[Section]` field holds (None for any other type)."""
    args = typing.get_args(tp) if typing.get_origin(tp) is list else ()
    return args[0] if args and _is_section(args[0]) else None


def _union_args(tp: Any) -> tuple[Any, ...]:
    """Members of a union (one-tuple otherwise), each stripped of Annotated."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return tuple(a.__origin__ if typing.get_origin(a) is Annotated else a for a in args)


def _render_type(tp: Any) -> str:
    parts = []
    for a in _union_args(tp):
        if typing.get_origin(a) is Literal:
            parts.append("|".join(f'"{v}"' for v in typing.get_args(a)))
        elif a is type(None):
            parts.append("null")
        elif typing.get_origin(a) is list:
            parts.append(f"list[{_render_type(typing.get_args(a)[0])}]")
        else:
            parts.append(getattr(a, "__name__", str(a)))
    return " | ".join(parts)


def describe_config(cfg: Config | None = None) -> str:
    """Every key as `key: type = value  # doc` (defaults, or the values of `cfg`), sections as comments."""
    lines: list[str] = []

    def walk(cls: type, obj: Any, prefix: str) -> None:
        for name, f in _fields(cls).items():
            value = getattr(obj, name)
            if _is_section(f.type):
                lines.append(f"\n# {prefix}{name}: {f.doc}")
                walk(f.type, value, f"{prefix}{name}.")
                continue
            doc = f"{f.doc} [{f.rule}]" if f.rule else f.doc
            shown = msgspec.json.encode(value).decode()
            lines.append(f"{prefix}{name}: {_render_type(f.type)} = {shown}  # {doc}")
            item = _list_item_section(f.type)
            for x in msgspec.structs.fields(item) if item is not None else ():  # a list of groups (tools.mcp)
                sf = _fields(item)[x.name]
                default = x.default_factory() if x.default_factory is not msgspec.NODEFAULT else x.default
                shown = "(required)" if x.required else f"= {msgspec.json.encode(default).decode()}"
                sdoc = f"{sf.doc} [{sf.rule}]" if sf.rule else sf.doc
                lines.append(f"{prefix}{name}[].{x.name}: {_render_type(sf.type)} {shown}  # {sdoc}")

    walk(Config, cfg if cfg is not None else Config(), "")
    return "\n".join(lines).lstrip("\n") + "\n"


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    keys = []
    for name, f in _fields(cls).items():
        keys += _all_keys(f.type, f"{prefix}{name}.") if _is_section(f.type) else [f"{prefix}{name}"]
    return keys
