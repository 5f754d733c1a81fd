"""One loader for every setting that names code: a built-in name, ``module:function`` or
``path/file.py:function`` (workflows, rewards, tools, judge parse rules, built-in tasks).

    load_plugin("multi_turn_tools", "workflow", builtins=WORKFLOWS)   -> the built-in
    load_plugin("my_pkg.rewards:score", "reward function")            -> my_pkg.rewards.score
    load_plugin("rewards.py:Judge.score", "reward function")          -> a method of a class in a file

Every failure is a `PluginError` (a ValueError) whose message names what the setting was meant to be
and what is wrong, in one line. This module imports nothing of streamrl: every layer may use it.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# `module:attr` or `file.py:attr`, attr dotted for a class's method: what a config value must look like.
SPEC_RE = re.compile(r"^(?:[A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_][\w.]*$")


class PluginError(ValueError):
    """A setting that names code which cannot be loaded; `str()` is one line."""


def is_spec(text: str) -> bool:
    """Whether `text` has the shape of ``module:function`` / ``file.py:function``."""
    return bool(SPEC_RE.match(text))


def load_plugin(spec: str, what: str, builtins: Mapping[str, Any] | None = None) -> Any:
    """The built-in `spec` names (from `builtins`), or the callable at ``module:attr`` /
    ``file.py:attr`` (attr may be dotted: ``Class.method``). `what` says what it is meant to be
    ("workflow", "reward function", ...) in error messages."""
    if builtins is not None and spec in builtins:
        return builtins[spec]
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        known = f" or one of: {', '.join(builtins)}" if builtins else ""
        raise PluginError(f"{what} {spec!r} must look like 'module:function' or 'file.py:function'{known}")
    obj: Any = _import(module_name, what)
    walked = module_name
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise PluginError(f"{what} {spec!r}: {walked!r} has no attribute {attr!r}")
        obj = getattr(obj, attr)
        walked = f"{walked}:{attr}" if walked == module_name else f"{walked}.{attr}"
    if not callable(obj):
        raise PluginError(f"{what} {spec!r} is a {type(obj).__name__}, which is not callable")
    return obj


def _import(module_name: str, what: str) -> Any:
    # "path/to/file.py:fn" loads a file directly, so a one-off reward or tool needs no package.
    if module_name.endswith(".py"):
        file = Path(module_name)
        if not file.is_file():
            raise PluginError(f"{what} module file {file} does not exist")
        spec = importlib.util.spec_from_file_location(f"_streamrl_plugin_{file.stem}", file)
        if spec is None or spec.loader is None:
            raise PluginError(f"cannot load {what} module file {file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: its error in one line
            raise PluginError(f"{what} module file {file} failed to load: {type(e).__name__}: {e}") from e
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # "not found" only when it is the named module (or a parent) that is missing; a missing
        # dependency *inside* the module is a different problem and must not be disguised as this one.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise PluginError(f"{what} module {module_name!r} not found (is it on PYTHONPATH?)") from e
        raise PluginError(f"{what} module {module_name!r} failed to import: {e}") from e


def plugin_name(fn: Callable[..., Any]) -> str:
    """A loaded plug-in's name as a spec would write it (for summaries and cache keys)."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
