"""Cross-field rules that no single field can check."""

import difflib
import importlib.util
import re
import shutil
import string
from pathlib import Path

from ..plugins import SPEC_RE as _REWARD_RE  # module:fn or file.py:fn, as the plug-in loader reads it
from .schema import DATA_SUFFIXES, JUDGE_TEMPLATE_FIELDS, KNOWN_TASKS, Config, ConfigError, EnginesConfig

_URL_RE = re.compile(r"^https?://[^\s/]+")


def validate(cfg: Config, *, check_paths: bool = True) -> None:
    """Cross-field rules that no single field can check; raises the first ConfigError found."""
    m, d, e = cfg.model, cfg.data, cfg.engines
    if check_paths:
        mp = Path(m.path)
        if mp.exists() and not mp.is_dir():
            raise ConfigError("model.path", f"'{m.path}' is not a folder")
        if not mp.exists() and m.init == "none":
            raise ConfigError(
                "model.path", f"folder '{m.path}' does not exist (or set model.init=tiny to build one)"
            )
    _check_reasoning_gym(cfg)
    if d.task is not None and d.path is not None:
        raise ConfigError(
            "data.path", "data.task and data.path are both set; set exactly one (e.g. data.task=null)"
        )
    if d.task is None and d.path is None and d.source == "default":
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
    if d.reward is not None and d.reward not in ("math", "judge") and not _REWARD_RE.match(d.reward):
        raise ConfigError("data.reward", f"expected 'math', 'judge', 'module:function' or 'file.py:function', got "
                                         f"'{d.reward}'")
    wf = cfg.rollout.workflow
    if wf not in ("single_turn", "multi_turn_tools") and not _REWARD_RE.match(wf):
        raise ConfigError("rollout.workflow", f"expected single_turn, multi_turn_tools, 'module:function' or "
                                              f"'file.py:function', got '{wf}'")
    for i, spec in enumerate(cfg.tools.functions):
        name, eq, target = spec.partition("=")
        if not (name == "calculator" and not eq) and not (eq and name.isidentifier() and _REWARD_RE.match(target)):
            raise ConfigError(f"tools.functions[{i}]", f"expected 'calculator' or 'name=module:function', got '{spec}'")
    _check_mcp(cfg, check_paths)
    if e.max_total_tokens is not None and e.max_total_tokens < cfg.rollout.max_new_tokens:
        raise ConfigError(
            "engines.max_total_tokens",
            f"must be >= rollout.max_new_tokens ({cfg.rollout.max_new_tokens}), got {e.max_total_tokens}",
        )
    _check_pool(e, "engines")
    if e.backend == "vllm":
        if cfg.rollout.partial in ("retract", "in_place"):
            # vLLM has no retract, and a run keeping requests across a vLLM reload is not tested here.
            raise ConfigError("rollout.partial", f"'{cfg.rollout.partial}' needs the streamrl engine or SGLang; "
                                                 "with vLLM servers use resume or discard")
        if 0 < cfg.rollout.temperature < 0.01:
            raise ConfigError("rollout.temperature", "vLLM samples at >= 0.01 (it raises smaller values); "
                                                     f"use 0 (greedy) or >= 0.01, got {cfg.rollout.temperature}")
    if e.colocate and cfg.schedule.push_every != 1:
        # The engines are paused through every step anyway, and the push after it is what resumes them.
        raise ConfigError("schedule.push_every", f"colocated engines take the weights after every step: needs 1, "
                                                 f"got {cfg.schedule.push_every}")
    _check_judge(cfg)
    _check_lora(cfg)
    lg = cfg.logging  # the curve writers' packages: missing ones stop the run here, not after its first step
    for key, on, module in (("logging.tensorboard", lg.tensorboard, "tensorboard"), ("logging.wandb", lg.wandb, "wandb")):
        if on and importlib.util.find_spec(module) is None:
            raise ConfigError(key, f"the {module} package is not installed (pip install {module}), or set {key}=false")
    if cfg.rollout.top_k == 0:
        raise ConfigError("rollout.top_k", "expected -1 (off) or >= 1, got 0")
    eta = cfg.controller.max_staleness
    if cfg.schedule.push_every > eta + 1:
        raise ConfigError(
            "schedule.push_every",
            f"must be <= controller.max_staleness + 1 ({eta + 1}): between two pushes the engines lag the "
            f"trainer by up to push_every - 1 versions, and no group may start more than max_staleness "
            f"versions before it is trained; got {cfg.schedule.push_every}",
        )
    cap = cfg.buffer.capacity
    if cap is not None and cap < cfg.schedule.batch_groups:
        raise ConfigError(
            "buffer.capacity",
            f"must be >= schedule.batch_groups ({cfg.schedule.batch_groups}) or no batch can fill, got {cap}",
        )
    if cfg.rollout.dynamic_sampling and cfg.rollout.group_size < 2:
        raise ConfigError("rollout.dynamic_sampling", "needs rollout.group_size >= 2 (a group of one has no variance)")
    if cfg.controller.deterministic:
        _check_deterministic(cfg)


def _check_mcp(cfg: Config, check_paths: bool) -> None:
    """tools.mcp: the mcp SDK installed, servers named once, run by a workflow that calls tools, from commands
    that exist (one that exists but does not start is found when the run starts it, before any engine)."""
    if cfg.tools.mcp and cfg.rollout.workflow == "single_turn":
        raise ConfigError("tools.mcp", "rollout.workflow: single_turn calls no tools; set multi_turn_tools or your "
                                       "own workflow")
    if cfg.tools.mcp and importlib.util.find_spec("mcp") is None:
        raise ConfigError("tools.mcp", "the mcp package is not installed (pip install 'mcp>=2,<3')")
    seen: dict[str, int] = {}
    for i, s in enumerate(cfg.tools.mcp):
        key = f"tools.mcp[{i}]"
        if s.name in seen:
            raise ConfigError(f"{key}.name", f"'{s.name}' is also the name of tools.mcp[{seen[s.name]}]")
        seen[s.name] = i
        if not check_paths:
            continue
        if s.cwd is not None and not Path(s.cwd).is_dir():
            raise ConfigError(f"{key}.cwd", f"folder '{s.cwd}' does not exist")
        exe = s.command[0]
        if exe == "python":  # the run's own interpreter (rollout/mcp_tools.py)
            continue
        if "/" in exe and s.cwd is not None:  # a relative path is the server's, from its cwd
            exe = str(Path(s.cwd) / exe)
        if shutil.which(exe, path=s.env.get("PATH")) is None:
            raise ConfigError(f"{key}.command", f"'{s.command[0]}' is not an executable file"
                                                + ("" if "/" in exe else " on PATH"))


def _check_reasoning_gym(cfg: Config) -> None:
    """data.source: reasoning_gym's own rules; the task names and generator settings are checked by the
    package itself when the records are made (streamrl/tasks/gym_tasks.py), before any work."""
    d = cfg.data
    if d.source != "reasoning_gym":
        if d.tasks:
            raise ConfigError("data.tasks", "only read with data.source: reasoning_gym")
        return
    if d.path is not None:
        raise ConfigError("data.path", "data.source: reasoning_gym generates its prompts; set data.path=null")
    if not d.tasks:
        raise ConfigError("data.tasks", "data.source: reasoning_gym needs at least one task, e.g. "
                                        "[{name: basic_arithmetic, config: {max_terms: 2}}]")
    for i, t in enumerate(d.tasks):
        taken = sorted({"seed", "size"} & set(t.config))
        if taken:
            raise ConfigError(f"data.tasks[{i}].config", f"{' and '.join(taken)}: streamrl's to set (from the run's "
                                                         "seed, data.train_size and data.eval_size)")
    if d.answer_format != "raw":
        try:
            re.compile(d.answer_format)
        except re.error as err:
            raise ConfigError("data.answer_format", f"expected raw, a tag such as '<answer>', or a regex; "
                                                    f"'{d.answer_format}' is not a valid regex ({err})") from None


def _check_lora(cfg: Config) -> None:
    lo, e, key = cfg.trainer.lora, cfg.engines, "trainer.lora.rank"
    if not lo.rank:
        return
    if e.pool == "http" and e.weight_sync == "distributed":
        raise ConfigError(key, "LoRA pushes adapters through the servers' load_lora_adapter; engines.weight_sync: "
                               "distributed broadcasts full weights only: use disk")
    if e.pool == "ray_serve" and e.engine == "sglang":
        raise ConfigError(key, "sglang.Engine replicas (engines.engine: sglang) take full weights only here; use "
                               "engines.engine: torch, or pool: http with SGLang servers started with --enable-lora")
    if "all-linear" in lo.target_modules and len(lo.target_modules) > 1:
        raise ConfigError("trainer.lora.target_modules", "all-linear already names every linear layer; give it alone "
                                                         f"or list modules, got {lo.target_modules}")


def _check_deterministic(cfg: Config) -> None:
    """What a reproducible run needs: every input to an engine step decided by logical events."""
    key = "controller.deterministic"
    if cfg.engines.pool != "local" or cfg.engines.num_replicas != 1:
        raise ConfigError(key, "needs engines.pool: local with engines.num_replicas: 1 (several engines, or engines "
                               f"in other processes, step in wall-clock order); got pool '{cfg.engines.pool}' with "
                               f"{cfg.engines.num_replicas} replica(s)")
    if cfg.rollout.workflow != "single_turn":
        raise ConfigError(key, "needs rollout.workflow: single_turn (tools run in wall-clock time)")
    if cfg.rollout.partial not in ("resume", "discard"):
        raise ConfigError(key, f"needs rollout.partial: resume or discard, got '{cfg.rollout.partial}'")
    if cfg.schedule.eval_every:
        raise ConfigError(key, "needs schedule.eval_every: 0 (an evaluation during the run shares engine steps with "
                               "rollouts at wall-clock times); the evaluations before and after the run stay")
    if cfg.schedule.push_every != 1:
        raise ConfigError(key, f"needs schedule.push_every: 1, got {cfg.schedule.push_every}")
    if cfg.schedule.resume_from is not None:
        raise ConfigError(key, "a run continued from a checkpoint (schedule.resume_from) is not made reproducible")
    if cfg.engines.colocate:
        raise ConfigError(key, "not with engines.colocate")


def template_fields(template: str) -> list[str]:
    """The record fields a `judge.prompt_template` names (ValueError for a malformed one)."""
    return [f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(template) if f is not None]


def _check_pool(e: EnginesConfig, key: str) -> None:
    """The rules of an engines section (`engines`, `judge.engines`) on their own."""
    if e.pool == "http" and e.router and e.router != "launch" and not e.urls:
        raise ConfigError(f"{key}.urls", "a router needs the worker URLs too (control calls go to every worker)")
    for i, url in enumerate(e.urls):
        if not _URL_RE.match(url):
            raise ConfigError(f"{key}.urls[{i}]", f"expected an http:// or https:// URL, got '{url}'")
    if e.backend == "vllm":
        if e.pool != "http":
            raise ConfigError(f"{key}.backend", f"vllm servers need {key}.pool: http, got pool '{e.pool}'")
        if e.router is not None:
            raise ConfigError(f"{key}.router", f"sglang-router does not front vLLM servers; set {key}.router=null")
        if e.weight_sync != "disk":
            raise ConfigError(f"{key}.weight_sync", "vLLM servers on CPU reload weights from disk only; use disk")
    if e.colocate and e.pool != "local":
        raise ConfigError(f"{key}.colocate", f"colocated engines run in this process: needs {key}.pool: local, got "
                                             f"'{e.pool}'")
    if e.colocate_offload_weights and not e.colocate:
        raise ConfigError(f"{key}.colocate_offload_weights", f"only with {key}.colocate: true")
    if e.engine == "sglang" and e.pool != "ray_serve":
        raise ConfigError(f"{key}.engine", f"sglang replicas need {key}.pool: ray_serve, got pool '{e.pool}'")
    if e.router is not None and e.router != "launch" and not _URL_RE.match(e.router):
        raise ConfigError(f"{key}.router", f"expected an http:// or https:// URL or 'launch', got '{e.router}'")


def _check_judge(cfg: Config) -> None:
    j, d = cfg.judge, cfg.data
    for key, spec in (("data.reward", d.reward), ("data.eval_reward", d.eval_reward)):
        if spec == "judge" and not j.enabled:
            raise ConfigError(key, "'judge' needs a judge: set judge.enabled: true (and judge.model.*)")
    if d.eval_reward is not None and d.eval_reward not in ("math", "judge", "task") and not _REWARD_RE.match(d.eval_reward):
        raise ConfigError("data.eval_reward", f"expected 'task', 'math', 'judge', 'module:function' or "
                                              f"'file.py:function', got '{d.eval_reward}'")
    if not j.enabled:
        return
    _check_pool(j.engines, "judge.engines")
    if j.engines.weight_sync != "disk":
        raise ConfigError("judge.engines.weight_sync", "the judge's weights never change: leave it disk")
    if j.engines.pool == "ray_serve":  # one Ray cluster per run, which the policy's pool owns and shuts down
        raise ConfigError("judge.engines.pool", "the judge serves from local or http (streamrl serve / vLLM) engines, "
                                                "not ray_serve")
    if j.engines.colocate:
        raise ConfigError("judge.engines.colocate", "the judge's engines are never paused for training; leave it false")
    if j.engines.backend == "vllm" and 0 < j.temperature < 0.01:
        raise ConfigError("judge.temperature", f"vLLM samples at >= 0.01; use 0 (greedy) or >= 0.01, got {j.temperature}")
    if j.top_k == 0:
        raise ConfigError("judge.top_k", "expected -1 (off) or >= 1, got 0")
    try:
        fields = template_fields(j.prompt_template)
    except ValueError as e:
        raise ConfigError("judge.prompt_template", f"not a valid template: {e}") from None
    unknown = [f for f in fields if f not in JUDGE_TEMPLATE_FIELDS]
    if unknown or not fields:
        raise ConfigError("judge.prompt_template", f"unknown field {{{unknown[0]}}} (fields: {', '.join(JUDGE_TEMPLATE_FIELDS)})"
                          if unknown else "names no field; it needs at least {response}")
    if j.parse not in ("yes_no", "number") and not _REWARD_RE.match(j.parse):
        raise ConfigError("judge.parse", f"expected yes_no, number, 'module:function' or 'file.py:function', got '{j.parse}'")
    if j.warm_start.enabled and (d.task != "addition" or d.source != "default"):
        raise ConfigError("judge.warm_start.enabled", "the built-in judge warm start grades data.task: addition; "
                                                      f"bring a trained judge (judge.model.path) for {d.task or d.path}")
    if j.warm_start.enabled and j.model.init == "tiny":
        raise ConfigError("judge.model.init", "the judge writes y / n, which the plain tiny vocabulary lacks: use tiny_agent")
    if cfg.controller.deterministic:
        raise ConfigError("controller.deterministic", "not with a judge (judge.enabled): its answers come in wall-clock order")
