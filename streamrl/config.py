"""The typed run configuration: one schema of msgspec Structs, loaded from YAML plus `--set` overrides.

This module owns the schema (every field has a default, a type, its constraints and a one-line doc in
`Meta(description=...)`, so `describe_config()` can list them), the cross-field rules in `validate()`,
and turning every mistake into one `ConfigError` line that names the dotted key. It knows nothing
about torch, engines or trainers: components read their section; they are never imported here.
"""

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

KNOWN_TASKS = ("addition",)  # built-in tasks (streamrl.tasks); kept here so config never imports them
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


class ConfigError(ValueError):
    """A bad configuration; `str(err)` is one line: `config error: <key>: <problem>`."""

    def __init__(self, key: str, problem: str) -> None:
        self.key, self.problem = key, problem
        super().__init__(f"config error: {key}: {problem}".replace("\n", " "))


def _d(doc: str, **constraints: Any) -> Meta:
    return Meta(description=doc, **constraints)


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


Device = Literal["auto", "cpu", "cuda"]
DType = Literal["float32", "bfloat16", "float16"]
Pool = Literal["local", "ray_serve", "http"]
Loss = Literal["grpo", "decoupled_ppo", "tis"]
PosIntOrNone = Annotated[int, Meta(ge=1)] | None
PosFloatOrNone = Annotated[float, Meta(gt=0)] | None


def _sec(cls: type) -> Any:
    return msgspec.field(default_factory=cls)


class ModelConfig(_Section):
    path: Annotated[str, _d("HF model folder: config.json, weights, tokenizer", min_length=1)] = (
        ".cache/streamrl/tiny-model"
    )
    init: Annotated[Literal["none", "tiny"], _d("tiny: build a tiny model at path if missing")] = "tiny"
    init_seed: Annotated[int, _d("seed for building the tiny model", ge=0)] = 0
    dtype: Annotated[DType, _d("parameter dtype for engines and trainer")] = "float32"
    device: Annotated[Device, _d("device of the embedded engines; auto = cuda if available")] = "auto"


class WarmStartConfig(_Section):
    enabled: Annotated[bool, _d("supervised warm start on noisy task labels before RL")] = False
    steps: Annotated[int, _d("warm-start optimizer steps", ge=1)] = 1000
    batch_size: Annotated[int, _d("warm-start examples per step", ge=1)] = 128
    lr: Annotated[float, _d("warm-start learning rate", gt=0)] = 1e-3
    label_noise: Annotated[float, _d("fraction of warm-start labels made wrong", ge=0, le=1)] = 0.5
    cache_dir: Annotated[str, _d("cache of warm-started weights, keyed by settings")] = ".cache/streamrl"


class DataConfig(_Section):
    task: Annotated[str | None, _d("built-in task name (exactly one of task / path)")] = "addition"
    path: Annotated[str | None, _d("JSONL / Parquet prompts file (exactly one of task / path)")] = None
    prompt_key: Annotated[str, _d("record field holding the prompt", min_length=1)] = "prompt"
    answer_key: Annotated[str, _d("record field holding the reference answer", min_length=1)] = "answer"
    reward: Annotated[str | None, _d("reward function 'module:function'; null = the task's own")] = None
    eval_size: Annotated[int, _d("held-out prompts for evaluation", ge=0)] = 200


class EnginesConfig(_Section):
    pool: Annotated[Pool, _d("where engines run: in-process, Ray Serve replicas, HTTP servers")] = "local"
    num_replicas: Annotated[int, _d("engine replicas (local / ray_serve / launched http servers)", ge=1)] = 1
    max_running_requests: Annotated[int, _d("concurrent requests per replica", ge=1)] = 64
    max_total_tokens: Annotated[PosIntOrNone, _d("KV-cache tokens per replica; null = engine decides")] = None
    urls: Annotated[list[str], _d(
        "server URLs for pool=http; empty = launch num_replicas servers (`streamrl serve`, or vLLM)"
    )] = (
        msgspec.field(default_factory=list)
    )
    router: Annotated[str | None, _d("sglang-router URL, or 'launch' to start one; null = route in-process")] = None
    backend: Annotated[Literal["sglang", "vllm"], _d(
        "pool=http server API: SGLang's native API (streamrl serve, SGLang) or a real vLLM server"
    )] = "sglang"
    vllm_python: Annotated[str | None, _d(
        "backend=vllm: Python of vLLM's environment; null = $STREAMRL_VLLM_PYTHON or .venv-vllm/bin/python"
    )] = None
    vllm_kv_cache_gib: Annotated[float, _d("backend=vllm: KV cache per launched server, GiB", gt=0)] = 1.0
    start_timeout_s: Annotated[float, _d("pool=http: seconds a launched server may take to become healthy", gt=0)] = (
        600.0
    )
    engine: Annotated[Literal["torch", "sglang"], _d(
        "engine inside each ray_serve replica: the embedded TorchEngine, or sglang.Engine (GPU build; unverified)"
    )] = "torch"
    cpus_per_replica: Annotated[float, _d("CPUs reserved per Ray replica", ge=0)] = 1.0
    gpus_per_replica: Annotated[float, _d("GPUs reserved per Ray replica; fractions share a GPU", ge=0)] = 0.0
    stream_interval: Annotated[int, _d(
        "ray_serve: tokens per streamed chunk (a lost replica costs at most this many per request)", ge=1
    )] = 8
    ray_address: Annotated[str | None, _d("ray_serve: address of a running Ray cluster; null = start one here")] = (
        None
    )
    threads: Annotated[int, _d("torch CPU threads per embedded engine", ge=1)] = 1
    cpu_kernel: Annotated[bool, _d(
        "embedded engine on CPU, float32: compiled C++ decode attention (built on first use, cached); "
        "false = PyTorch SDPA, same numbers, slower"
    )] = True
    weight_sync: Annotated[Literal["disk", "distributed"], _d("pool=http: safetensors folder or gloo broadcast")] = (
        "disk"
    )


class RolloutConfig(_Section):
    group_size: Annotated[int, _d("samples per prompt (GRPO group)", ge=1)] = 8
    max_new_tokens: Annotated[int, _d("response token budget per sample", ge=1)] = 8
    temperature: Annotated[float, _d("sampling temperature; 0 = greedy", ge=0)] = 1.0
    top_p: Annotated[float, _d("nucleus sampling mass", gt=0, le=1)] = 1.0
    top_k: Annotated[int, _d("top-k sampling; -1 = off", ge=-1)] = -1
    partial: Annotated[Literal["resume", "discard"], _d("samples interrupted by a weight sync")] = "resume"
    max_concurrent_groups: Annotated[PosIntOrNone, _d("groups in flight; null = controller decides")] = None


class ControllerConfig(_Section):
    max_staleness: Annotated[int, _d("max versions a token may lag the trainer; 0 = on-policy", ge=0)] = 0
    max_offpolicy_fraction: Annotated[float, _d("max off-policy share of a batch", ge=0, le=1)] = 1.0
    stale_policy: Annotated[Literal["drop", "keep"], _d("groups beyond max_staleness")] = "drop"


class BufferConfig(_Section):
    priority: Annotated[Literal["oldest_version", "fifo"], _d("pop order of queued groups")] = (
        "oldest_version"
    )
    capacity: Annotated[PosIntOrNone, _d("max queued groups (back-pressure); null = unbounded")] = None


class TrainerConfig(_Section):
    steps: Annotated[int, _d("optimizer steps", ge=1)] = 100
    batch_groups: Annotated[int, _d("prompts (groups) per step", ge=1)] = 8
    lr: Annotated[float, _d("learning rate", gt=0)] = 3e-5
    weight_decay: Annotated[float, _d("AdamW weight decay", ge=0)] = 0.0
    grad_clip: Annotated[float, _d("max gradient norm; 0 = off", ge=0)] = 1.0
    loss: Annotated[Loss, _d("policy loss")] = "grpo"
    clip_eps: Annotated[float, _d("PPO ratio clip epsilon", ge=0)] = 0.2
    clip_eps_high: Annotated[PosFloatOrNone, _d("upper clip epsilon (clip-higher); null = clip_eps")] = None
    kl_coef: Annotated[float, _d("KL penalty to the initial policy; 0 = off", ge=0)] = 0.0
    behav_imp_weight_cap: Annotated[PosFloatOrNone, _d("decoupled PPO behaviour-weight cap; null = none")] = (
        None
    )
    tis_cap: Annotated[float, _d("truncated importance sampling cap", gt=0)] = 2.0
    device: Annotated[Device, _d("trainer device; auto = cuda if available")] = "auto"
    eval_every: Annotated[int, _d("evaluate every N steps; 0 = never", ge=0)] = 0
    save_every: Annotated[int, _d("checkpoint every N steps; 0 = only at the end", ge=0)] = 0
    threads: Annotated[int, _d("torch CPU threads of the trainer", ge=1)] = 1
    micro_batch_tokens: Annotated[int, _d("padded tokens per forward/backward; gradients accumulate", ge=1)] = 4096
    micro_batch_padding: Annotated[float, _d(
        "padding allowed per micro-batch, as a fraction of its real tokens (samples bucketed by length)", ge=0
    )] = 0.25
    own_process: Annotated[bool, _d(
        "CPU trainer in its own process, away from the rollout manager's event loop (GIL)"
    )] = True
    skip_zero_advantage: Annotated[bool, _d(
        "skip forward/backward of samples with advantage 0 (the same update, less compute; off with kl_coef)"
    )] = True


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run_dir: Annotated[str, _d("output folder: metrics, checkpoints, plots", min_length=1)] = (
        "runs/quickstart"
    )
    seed: Annotated[int, _d("global random seed", ge=0)] = 0
    save_samples: Annotated[bool, _d("write every trained group to run_dir/samples.jsonl")] = False
    model: Annotated[ModelConfig, _d("policy model")] = _sec(ModelConfig)
    warm_start: Annotated[WarmStartConfig, _d("optional supervised warm start")] = _sec(WarmStartConfig)
    data: Annotated[DataConfig, _d("prompts and rewards")] = _sec(DataConfig)
    engines: Annotated[EnginesConfig, _d("generation engines and their pool")] = _sec(EnginesConfig)
    rollout: Annotated[RolloutConfig, _d("sampling and rollout scheduling")] = _sec(RolloutConfig)
    controller: Annotated[ControllerConfig, _d("off-policy ratio controller")] = _sec(ControllerConfig)
    buffer: Annotated[BufferConfig, _d("rollout buffer between manager and trainer")] = _sec(BufferConfig)
    trainer: Annotated[TrainerConfig, _d("optimizer and loss")] = _sec(TrainerConfig)


# ----------------------------------------------------------------------------------------- schema walk


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

    walk(Config, cfg if cfg is not None else Config(), "")
    return "\n".join(lines).lstrip("\n") + "\n"


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    keys = []
    for name, f in _fields(cls).items():
        keys += _all_keys(f.type, f"{prefix}{name}.") if _is_section(f.type) else [f"{prefix}{name}"]
    return keys


def _unknown_key(cls: type, parts: list[str], key: str) -> ConfigError:
    names = list(_fields(cls))
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    dotted = ".".join([*parts, str(key)])
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


# ----------------------------------------------------------------------------------------- public


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


def dump_config(cfg: Config) -> str:
    """YAML for `cfg`; `load_config` of it gives back an equal Config."""
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False, default_flow_style=False)


_REWARD_RE = re.compile(r"^(?:[A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_][\w.]*$")  # module:fn or file.py:fn
_URL_RE = re.compile(r"^https?://[^\s/]+")


def validate(cfg: Config, *, check_paths: bool = True) -> None:
    """Cross-field rules that no single field can check; raises the first ConfigError found."""
    m, d, e = cfg.model, cfg.data, cfg.engines
    if check_paths:
        mp = Path(m.path)
        if mp.exists() and not mp.is_dir():
            raise ConfigError("model.path", f"'{m.path}' is not a folder")
        if not mp.exists() and m.init != "tiny":
            raise ConfigError(
                "model.path", f"folder '{m.path}' does not exist (or set model.init=tiny to build one)"
            )
    if d.task is not None and d.path is not None:
        raise ConfigError(
            "data.path", "data.task and data.path are both set; set exactly one (e.g. data.task=null)"
        )
    if d.task is None and d.path is None:
        raise ConfigError("data.task", "neither data.task nor data.path is set; set exactly one")
    if d.task is not None and d.task not in KNOWN_TASKS:
        close = difflib.get_close_matches(d.task, KNOWN_TASKS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(KNOWN_TASKS)})"
        raise ConfigError("data.task", f"unknown task '{d.task}'{hint}")
    if d.path is not None:
        if not d.path.endswith(DATA_SUFFIXES):
            raise ConfigError("data.path", f"expected a {', '.join(DATA_SUFFIXES)} file, got '{d.path}'")
        if check_paths and not Path(d.path).is_file():
            raise ConfigError("data.path", f"file '{d.path}' does not exist")
    if d.reward is not None and not _REWARD_RE.match(d.reward):
        raise ConfigError("data.reward", f"expected 'module:function' or 'file.py:function', got '{d.reward}'")
    if e.max_total_tokens is not None and e.max_total_tokens < cfg.rollout.max_new_tokens:
        raise ConfigError(
            "engines.max_total_tokens",
            f"must be >= rollout.max_new_tokens ({cfg.rollout.max_new_tokens}), got {e.max_total_tokens}",
        )
    if e.pool == "http" and e.router and e.router != "launch" and not e.urls:
        raise ConfigError("engines.urls", "a router needs the worker URLs too (control calls go to every worker)")
    for i, url in enumerate(e.urls):
        if not _URL_RE.match(url):
            raise ConfigError(f"engines.urls[{i}]", f"expected an http:// or https:// URL, got '{url}'")
    if e.backend == "vllm":
        if e.pool != "http":
            raise ConfigError("engines.backend", f"vllm servers need engines.pool: http, got pool '{e.pool}'")
        if e.router is not None:
            raise ConfigError("engines.router", "sglang-router does not front vLLM servers; set engines.router=null")
        if e.weight_sync != "disk":
            raise ConfigError("engines.weight_sync", "vLLM servers on CPU reload weights from disk only; use disk")
        if 0 < cfg.rollout.temperature < 0.01:
            raise ConfigError("rollout.temperature", "vLLM samples at >= 0.01 (it raises smaller values); "
                                                     f"use 0 (greedy) or >= 0.01, got {cfg.rollout.temperature}")
    if e.engine == "sglang" and e.pool != "ray_serve":
        raise ConfigError("engines.engine", f"sglang replicas need engines.pool: ray_serve, got pool '{e.pool}'")
    if e.router is not None and e.router != "launch" and not _URL_RE.match(e.router):
        raise ConfigError("engines.router", f"expected an http:// or https:// URL or 'launch', got '{e.router}'")
    cap = cfg.buffer.capacity
    if cap is not None and cap < cfg.trainer.batch_groups:
        raise ConfigError(
            "buffer.capacity",
            f"must be >= trainer.batch_groups ({cfg.trainer.batch_groups}) or no batch can fill, got {cap}",
        )
