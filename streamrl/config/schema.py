"""The run configuration's schema: one msgspec Struct per section, every field with a default, a type,
its constraints and a one-line doc in `Meta(description=...)`, which `describe_config()` lists."""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

KNOWN_TASKS = ("addition", "multiply", "agent_multiply")  # built-in tasks (streamrl.tasks); kept here so config never imports them
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
JUDGE_TEMPLATE_FIELDS = ("prompt", "response", "answer", "metadata", "data_source")  # judge.prompt_template's


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
CapOrNone = Annotated[float, Meta(gt=1)] | None


def _sec(cls: type) -> Any:
    return msgspec.field(default_factory=cls)


class ModelConfig(_Section):
    path: Annotated[str, _d("HF model folder: config.json, weights, tokenizer", min_length=1)] = (
        ".cache/streamrl/tiny-model"
    )
    init: Annotated[Literal["none", "tiny", "tiny_agent", "tiny_tools", "tiny_text"], _d(
        "tiny: build a tiny model at path if missing; tiny_agent: with chat and tool-call tokens; tiny_tools: "
        "a chat template that renders tools and tool calls in the Hermes / Qwen form; tiny_text: every printable "
        "ASCII character and newline (English questions: data.source reasoning_gym), 128 positions"
    )] = "tiny"
    preset: Annotated[Literal["tiny", "small", "bench100m", "qwen2-0.1b", "qwen2.5-0.5b"], _d(
        "the shape init builds (random weights, the tiny vocabulary): tiny ~1 M parameters, small ~4 M, "
        "bench100m ~85 M, qwen2-0.1b ~0.1 B and qwen2.5-0.5b Qwen2.5-0.5B's layers (GPU)"
    )] = "tiny"
    init_seed: Annotated[int, _d("seed for building the tiny model", ge=0)] = 0


class WarmStartConfig(_Section):
    enabled: Annotated[bool, _d("supervised warm start on noisy task labels before RL")] = False
    steps: Annotated[int, _d("warm-start optimizer steps", ge=1)] = 1000
    batch_size: Annotated[int, _d("warm-start examples per step", ge=1)] = 128
    lr: Annotated[float, _d("warm-start learning rate", gt=0)] = 1e-3
    label_noise: Annotated[float, _d("fraction of warm-start labels made wrong", ge=0, le=1)] = 0.5
    cache_dir: Annotated[str, _d("cache of warm-started weights, keyed by settings")] = ".cache/streamrl"
    device: Annotated[Device, _d("device of the warm start; auto = cuda if available")] = "auto"
    warmup_steps: Annotated[Annotated[int, Meta(ge=0)] | None, _d(
        "linear learning-rate warmup before the cosine decay; null = the task recipe's own (addition: 0, "
        "the judge's: 100, reasoning_gym's: 30)"
    )] = None


class GymTaskConfig(_Section):
    name: Annotated[str, _d("a reasoning-gym task (dataset) name, e.g. basic_arithmetic", min_length=1)]
    weight: Annotated[float, _d("its share of the training and held-out records, relative to the other tasks'", gt=0)] = 1.0
    config: Annotated[dict[str, Any], _d(
        "the generator's own settings (the fields of its config class; seed and size are streamrl's)"
    )] = msgspec.field(default_factory=dict)


class DataConfig(_Section):
    task: Annotated[str | None, _d("built-in task name (exactly one of task / path; source: default)")] = "addition"
    path: Annotated[str | None, _d("JSONL / Parquet prompts file (exactly one of task / path)")] = None
    prompt_key: Annotated[str, _d(
        "record field holding the prompt (text, or a chat-message list rendered by the chat template); "
        "dotted for a nested field", min_length=1,
    )] = "prompt"
    answer_key: Annotated[str, _d(
        "record field holding the reference answer; dotted for a nested field (verl: "
        "reward_model.ground_truth, slime: label)", min_length=1,
    )] = "answer"
    reward: Annotated[str | None, _d(
        "reward function 'module:function' or 'file.py:function', or 'math' (built-in math-verify check: "
        "#### and \\boxed{} answers), or 'judge' (the judge's score, judge.*); null = the task's own"
    )] = None
    eval_size: Annotated[int, _d("held-out prompts for evaluation", ge=0)] = 200
    eval_reward: Annotated[str | None, _d(
        "reward of the held-out evaluation, as data.reward (or 'task': the built-in task's exact match); null = "
        "data.reward. Where it differs, evaluations also report how often the two rewards agree"
    )] = None
    source: Annotated[Literal["default", "reasoning_gym"], _d(
        "where the prompts come from: default = data.task or data.path; reasoning_gym = generated from data.tasks "
        "by the reasoning-gym package (pip install 'streamrl[envs]'), scored by each task's own score_answer"
    )] = "default"
    tasks: Annotated[list[GymTaskConfig], _d(
        "source reasoning_gym: the tasks mixed, each {name, weight, config}; metrics per task (docs/environments.md)"
    )] = msgspec.field(default_factory=list)
    train_size: Annotated[int, _d(
        "source reasoning_gym: training records generated, shared among data.tasks by weight", ge=1
    )] = 10000
    answer_format: Annotated[str, _d(
        "source reasoning_gym: the answer in a response: raw (all of it, stripped), a tag such as '<answer>' "
        "(inside the last <answer>...</answer>), or a regex (its last match: group 1 if it has groups)", min_length=1
    )] = "raw"


class EnginesConfig(_Section):
    pool: Annotated[Pool, _d("where engines run: in-process, Ray Serve replicas, HTTP servers")] = "local"
    num_replicas: Annotated[int, _d("engine replicas (local / ray_serve / launched http servers)", ge=1)] = 1
    device: Annotated[Device, _d("device of the embedded engines; auto = cuda if available")] = "auto"
    dtype: Annotated[DType, _d("parameter dtype of the engines")] = "float32"
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
    health_check_interval_s: Annotated[float, _d("pool=http: seconds between health checks of each server", gt=0)] = (
        1.0
    )
    health_check_timeout_s: Annotated[float, _d(
        "pool=http: a server that misses two health checks of this many seconds is lost (routed around, "
        "relaunched or waited for)", gt=0,
    )] = 5.0
    control_timeout_s: Annotated[float, _d(
        "pool=http: seconds a control call (pause, resume, weight load) may take before its server is lost", gt=0,
    )] = 300.0
    max_restarts: Annotated[int, _d("pool=http: relaunches of each launched server that was lost", ge=0)] = 3
    all_lost_timeout_s: Annotated[float, _d(
        "pool=http: seconds generation waits for a server when none is up, before the run stops", gt=0,
    )] = 120.0
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
    weight_sync: Annotated[Literal["disk", "distributed"], _d("pool=http: safetensors folder or gloo broadcast")] = (
        "disk"
    )
    kv_cache_fraction: Annotated[float, _d(
        "CUDA, max_total_tokens null: the KV cache takes at most this fraction of the GPU memory free after "
        "the weights are loaded", gt=0, le=1,
    )] = 0.3
    colocate: Annotated[bool, _d(
        "engines and trainer share the GPU (pool=local): around each training step the engines free their KV "
        "cache (and with colocate_offload_weights their weights) and take it back before the new weights load"
    )] = False
    colocate_offload_weights: Annotated[bool, _d("colocate: the engines' weights go to host memory during a step too")] = (
        False
    )


class VerifiersConfig(_Section):
    env: Annotated[str | None, _d(
        "rollout.environment verifiers: the taskset id of an installed verifiers environment (its module), or "
        "'module:function' / 'file.py:function' returning a verifiers.v1.Env (docs/environments.md)")] = None
    args: Annotated[dict[str, Any], _d(
        "an id: the environment config's fields (taskset.*, agent.harness.id, agent.runtime.type, ...); a function: "
        "its keyword arguments")] = msgspec.field(default_factory=dict)
    python: Annotated[str | None, _d(
        "Python of verifiers' own environment; null = $STREAMRL_VERIFIERS_PYTHON or .venv-verifiers/bin/python "
        "(bash scripts/setup_verifiers.sh)")] = None
    local_python: Annotated[bool, _d(
        "local (subprocess) runtimes run verifiers' bundled programs with that Python instead of a uv environment "
        "per script (which needs uv and the network)")] = True
    startup_timeout_s: Annotated[float, _d("seconds the environment may take to load and list its tasks", gt=0)] = 120.0


class RolloutConfig(_Section):
    group_size: Annotated[int, _d("samples per prompt (GRPO group)", ge=1)] = 8
    max_new_tokens: Annotated[int, _d("response token budget per sample", ge=1)] = 8
    temperature: Annotated[float, _d("sampling temperature; 0 = greedy", ge=0)] = 1.0
    top_p: Annotated[float, _d("nucleus sampling mass", gt=0, le=1)] = 1.0
    top_k: Annotated[int, _d("top-k sampling; -1 = off, else >= 1", ge=-1)] = -1
    partial: Annotated[
        Literal["resume", "discard", "retract", "in_place"],
        _d("samples in flight at a weight sync: resume (abort, resubmit, KV recomputed), discard (restart), "
           "retract (kept in the engine, KV recomputed), in_place (kept, old KV reused)"),
    ] = "resume"
    workflow: Annotated[str, _d(
        "how one sample is generated: single_turn (prompt -> completion), multi_turn_tools (the model "
        "calls tools, see tools.*), or 'module:function' / 'file.py:function', an async "
        "workflow(record, episode) (docs/agentic.md)", min_length=1,
    )] = "single_turn"
    max_turns: Annotated[int, _d("multi_turn_tools: model turns per sample at most", ge=1)] = 4
    environment: Annotated[Literal["none", "verifiers"], _d(
        "none: prompts and rewards from data.*; verifiers: a verifiers environment (rollout.verifiers) gives the "
        "prompts (its taskset), runs each episode (its harness and tools) and scores it (its rewards)")] = "none"
    verifiers: Annotated[VerifiersConfig, _d("rollout.environment: verifiers")] = _sec(VerifiersConfig)
    tool_parser: Annotated[str, _d(
        "capture endpoint: how a model's answer is read as tool calls when the agent declares tools: hermes "
        "(<tool_call>{json}</tool_call>, Hermes / Qwen templates) or 'module:function' (docs/agentic.md)",
        min_length=1)] = "hermes"
    dynamic_sampling: Annotated[bool, _d(
        "DAPO's dynamic sampling: a group whose rewards are all equal (no GRPO signal) is not trained; its "
        "slot goes to a new prompt, so every batch holds schedule.batch_groups groups with signal"
    )] = False
    max_draws_per_batch: Annotated[int, _d(
        "dynamic_sampling: the run stops with a message once this many times schedule.batch_groups "
        "groups in a row carried no signal (the data is exhausted of signal for this policy)", ge=1,
    )] = 8


class McpServerConfig(_Section):
    name: Annotated[str, _d(
        "the server's name, in errors and logs, and before its tools' names with prefix: true (letters, digits, _ -)",
        pattern=r"^[A-Za-z0-9_-]+$",
    )]
    command: Annotated[list[str], _d(
        "the command that starts the server on stdio, e.g. [python, examples/mcp_calculator_server.py]; "
        "python is the run's own interpreter", min_length=1,
    )]
    env: Annotated[dict[str, str], _d(
        "environment of the server, over the mcp SDK's minimal one (HOME, LOGNAME, PATH, SHELL, TERM, USER)"
    )] = msgspec.field(default_factory=dict)
    cwd: Annotated[str | None, _d("working directory of the server; null = the run's")] = None
    timeout_s: Annotated[PosFloatOrNone, _d(
        "a call to one of its tools running longer is an error observation; null = tools.timeout_s"
    )] = None
    startup_timeout_s: Annotated[float, _d(
        "seconds the server may take to start and list its tools (at run start, and when it is restarted)", gt=0,
    )] = 30.0
    prefix: Annotated[bool, _d("its tools are named NAME_TOOL (name, then the server's tool name), not TOOL")] = False


class PythonToolConfig(_Section):
    enabled: Annotated[bool, _d(
        "offer the built-in tool `python`: the model's code (the text of the call, or {\"code\": ...}) runs "
        "in a sandbox, a fresh one per call (docs/environments.md)"
    )] = False
    timeout_s: Annotated[float, _d("wall-clock seconds a call may run; then all its processes are killed", gt=0)] = (
        10.0
    )
    cpu_s: Annotated[int, _d("CPU seconds each of its processes may use (RLIMIT_CPU)", ge=1)] = 10
    memory_mb: Annotated[int, _d("address space of each of its processes, MiB (RLIMIT_AS)", ge=64)] = 512
    max_processes: Annotated[int, _d(
        "processes and threads it may have at once, itself included (RLIMIT_NPROC, counted in a user "
        "namespace of its own)", ge=1,
    )] = 8
    max_file_mb: Annotated[int, _d(
        "MiB it may write: each file (RLIMIT_FSIZE) and, with namespaces, its whole working directory (a tmpfs)",
        ge=1,
    )] = 16
    max_output_bytes: Annotated[int, _d(
        "stdout and stderr together; a call that writes more is killed and its output cut there", ge=1,
    )] = 16384
    network: Annotated[Literal["none", "allowed"], _d(
        "none: a network namespace of its own (a loopback that is down), and the tool refuses to start where "
        "the kernel makes none; allowed: the host's network"
    )] = "none"


class ToolsConfig(_Section):
    functions: Annotated[list[str], _d(
        "tools the model may call: 'calculator' (built in) or 'name=module:function' (sync or async, "
        "one str argument, returns the observation)"
    )] = msgspec.field(default_factory=lambda: ["calculator"])
    timeout_s: Annotated[float, _d("a tool call running longer is an error observation", gt=0)] = 5.0
    mcp: Annotated[list[McpServerConfig], _d(
        "MCP servers started over stdio for the run's life, each {name, command, env, cwd, timeout_s, "
        "startup_timeout_s, prefix}; their tools are called like tools.functions' (docs/environments.md)"
    )] = msgspec.field(default_factory=list)
    call_open: Annotated[str, _d("text that opens a tool call: call_open NAME: ARGS call_close", min_length=1)] = (
        "<tool>"
    )
    call_close: Annotated[str, _d("text that closes a tool call (generation stops there)", min_length=1)] = "</tool>"
    result_open: Annotated[str, _d("text before a tool's observation (masked out of the loss)")] = "<result>"
    result_close: Annotated[str, _d("text after a tool's observation (masked out of the loss)")] = "</result>"
    python: Annotated[PythonToolConfig, _d("the built-in sandboxed Python tool `python`")] = _sec(PythonToolConfig)


class JudgeConfig(_Section):
    enabled: Annotated[bool, _d(
        "a judge model on its own engines, for data.reward: judge or a reward function taking `judge` (never "
        "paused, updated or aborted by training)"
    )] = False
    model: Annotated[ModelConfig, _d("the judge model")] = msgspec.field(
        default_factory=lambda: ModelConfig(path=".cache/streamrl/tiny-judge", init="tiny_agent"))
    warm_start: Annotated[WarmStartConfig, _d(
        "the judge's own offline training (the built-in recipe grades data.task: addition), cached like the policy's"
    )] = msgspec.field(default_factory=lambda: WarmStartConfig(steps=1500, lr=1e-3, label_noise=0.0))
    engines: Annotated[EnginesConfig, _d("the judge's engines and their pool (local, http, or http with backend vllm)")] = (
        _sec(EnginesConfig)
    )
    prompt_template: Annotated[str, _d(
        "the judge's prompt, with {prompt} {response} {answer} {data_source} {metadata[KEY]} of the record", min_length=1,
    )] = "Question: {prompt}\nAnswer: {response}\nIs the answer correct? Reply yes or no.\n"
    chat: Annotated[bool, _d("render the prompt as one user message through the judge tokenizer's chat template")] = False
    parse: Annotated[str, _d(
        "judge text -> score: yes_no (the last word: yes 1.0 / no 0.0), number (the last number), or "
        "'module:function' called as fn(text, logprobs), sync or async"
    )] = "yes_no"
    max_new_tokens: Annotated[int, _d("the judge's token budget per judgment", ge=1)] = 16
    temperature: Annotated[float, _d("the judge's sampling temperature; 0 = greedy", ge=0)] = 0.0
    top_p: Annotated[float, _d("the judge's nucleus sampling mass", gt=0, le=1)] = 1.0
    top_k: Annotated[int, _d("the judge's top-k; -1 = off", ge=-1)] = -1
    stop: Annotated[list[str], _d("strings that end the judge's text")] = msgspec.field(default_factory=list)
    timeout_s: Annotated[float, _d("seconds one try of a judgment may take", gt=0)] = 60.0
    retries: Annotated[int, _d(
        "tries after a failed one (timeout, aborted request, unparsable text); then the group fails", ge=0,
    )] = 2
    min_agreement: Annotated[Annotated[float, Meta(ge=0, le=1)] | None, _d(
        "RL starts only on a judge that agrees with exact match at least this often: on its warm start's held-out "
        "examples, and on the held-out evaluation before RL (with data.eval_reward); null = no check",
    )] = None


class ControllerConfig(_Section):
    max_staleness: Annotated[int, _d("max versions a token may lag the trainer; 0 = on-policy", ge=0)] = 0
    max_offpolicy_fraction: Annotated[float, _d("max off-policy share of a batch", ge=0, le=1)] = 1.0
    stale_policy: Annotated[Literal["drop", "keep"], _d("groups beyond max_staleness")] = "drop"
    max_concurrent_groups: Annotated[PosIntOrNone, _d("groups generating at once; null = admission alone decides")] = (
        None
    )
    deterministic: Annotated[bool, _d(
        "reproducible async runs (pool=local, one engine, single_turn): every scheduling decision follows "
        "logical events, not wall time; a weight update lands when the batch after the one it was trained "
        "on is complete (the engine waits if the trainer is late), so two runs of one config and seed give "
        "the same metrics, samples and weights (docs/async.md)"
    )] = False


class BufferConfig(_Section):
    priority: Annotated[Literal["oldest_version", "fifo"], _d("pop order of queued groups")] = (
        "oldest_version"
    )
    capacity: Annotated[PosIntOrNone, _d("max queued groups (back-pressure); null = unbounded")] = None


class LoraConfig(_Section):
    rank: Annotated[int, _d(
        "LoRA rank: train low-rank adapters on a frozen base (peft) and push only them to the engines; 0 = off "
        "(every weight trains)", ge=0,
    )] = 0
    alpha: Annotated[PosFloatOrNone, _d("LoRA alpha (the update is scaled by alpha / rank); null = 2 x rank")] = None
    dropout: Annotated[float, _d("dropout on the adapters' input while training", ge=0, lt=1)] = 0.0
    target_modules: Annotated[list[str], _d(
        "the base model's linear modules that get adapters, by name (q_proj, ...); [all-linear] = every linear "
        "layer but the output head", min_length=1,
    )] = msgspec.field(default_factory=lambda: ["all-linear"])
    lr: Annotated[PosFloatOrNone, _d(
        "the adapters' learning rate; null = 10 x trainer.lr (LoRA's best rate is about ten times full "
        "fine-tuning's)"
    )] = None
    merge_final: Annotated[bool, _d("final/ holds the merged model as well (final/merged), besides the adapter")] = False


class TrainerConfig(_Section):
    lr: Annotated[float, _d("learning rate", gt=0)] = 3e-5
    weight_decay: Annotated[float, _d("AdamW weight decay", ge=0)] = 0.0
    grad_clip: Annotated[float, _d("max gradient norm; 0 = off", ge=0)] = 1.0
    loss: Annotated[Loss, _d(
        "policy loss: grpo (PPO clip against the behaviour policy), decoupled_ppo (AReaL: clip against "
        "pi_prox, weighted by pi_prox/pi_behav), tis (clip against pi_prox, truncated behaviour weight)"
    )] = "grpo"
    clip_eps: Annotated[float, _d("PPO ratio clip epsilon", gt=0, lt=1)] = 0.2
    clip_eps_high: Annotated[PosFloatOrNone, _d("upper clip epsilon (clip-higher); null = clip_eps")] = None
    kl_coef: Annotated[float, _d("k3 KL penalty to the initial policy; 0 = off", ge=0)] = 0.0
    behav_imp_weight_cap: Annotated[CapOrNone, _d(
        "decoupled_ppo: tokens whose pi_prox/pi_behav exceeds it leave the loss; null = no cap"
    )] = None
    tis_cap: Annotated[float, _d("tis: the behaviour weight is truncated at this value", gt=0)] = 2.0
    ppo_minibatches: Annotated[int, _d(
        "optimizer steps per batch, each on about 1/N of its tokens (AReaL's ppo_n_minibatches); pi_prox is the "
        "weights before the first, so decoupled_ppo/tis clip against it from the second on; 1 = one step, "
        "where that clip never binds", ge=1,
    )] = 1
    device: Annotated[Device, _d("trainer device; auto = cuda if available")] = "auto"
    dtype: Annotated[Literal["float32", "bfloat16"], _d(
        "compute dtype: bfloat16 = autocast, with float32 master weights and optimizer state"
    )] = "float32"
    gradient_checkpointing: Annotated[bool, _d("recompute activations in the backward pass: less memory, ~30 % more compute")] = (
        False
    )
    threads: Annotated[int, _d("torch CPU threads of the trainer", ge=1)] = 1
    micro_batch_tokens: Annotated[int, _d("padded tokens per forward/backward; gradients accumulate", ge=1)] = 4096
    micro_batch_padding: Annotated[float, _d(
        "padding allowed per micro-batch, as a fraction of its real tokens (samples bucketed by length)", ge=0
    )] = 0.25
    lora: Annotated[LoraConfig, _d("low-rank adapters instead of full fine-tuning (rank 0 = off)")] = _sec(LoraConfig)


class ScheduleConfig(_Section):
    steps: Annotated[int, _d("optimizer steps (one batch each)", ge=1)] = 100
    batch_groups: Annotated[int, _d("prompts (groups) per step", ge=1)] = 8
    push_every: Annotated[int, _d(
        "push the weights to the engines every N steps (and at the last step and each evaluation): "
        "fewer interruptions of samples in flight; the engines lag up to N-1 versions (needs "
        "controller.max_staleness >= N-1)", ge=1,
    )] = 1
    eval_every: Annotated[int, _d("held-out evaluation every N steps; 0 = before and after the run only", ge=0)] = 0
    save_every: Annotated[int, _d(
        "checkpoint (policy, optimizer, rollout state) every N steps to run_dir/checkpoints; 0 = none "
        "(final/ is always written)", ge=0,
    )] = 0
    resume_from: Annotated[str | None, _d(
        "continue a run from a checkpoint folder (run_dir/checkpoints/step-N): policy, optimizer, rollout state"
    )] = None


class LoggingConfig(_Section):
    tensorboard: Annotated[bool, _d(
        "every numeric metrics.jsonl field as a TensorBoard scalar at its step, under tensorboard_dir"
    )] = False
    tensorboard_dir: Annotated[str | None, _d(
        "folder of the TensorBoard event files; null = run_dir/tensorboard (`streamrl sweep` gives each point "
        "SWEEP_DIR/tensorboard/<point>, so one `tensorboard --logdir SWEEP_DIR/tensorboard` overlays them)"
    )] = None
    wandb: Annotated[bool, _d("every row to Weights & Biases too (needs `pip install wandb`); see wandb_mode")] = False
    wandb_project: Annotated[str, _d("the wandb project of the run", min_length=1)] = "streamrl"
    wandb_mode: Annotated[Literal["offline", "online"], _d(
        "offline: written under run_dir/wandb (upload later with `wandb sync`); online: streamed to the server"
    )] = "offline"


# Keys that moved or left: each is a one-line config error that says where it went.
RENAMED = {
    "trainer.steps": "schedule.steps", "trainer.batch_groups": "schedule.batch_groups",
    "trainer.push_every": "schedule.push_every", "trainer.eval_every": "schedule.eval_every",
    "trainer.save_every": "schedule.save_every", "trainer.resume_from": "schedule.resume_from",
    "rollout.max_concurrent_groups": "controller.max_concurrent_groups",
    "model.device": "engines.device", "model.dtype": "engines.dtype",
}
REMOVED = {
    "trainer.stream_batch": "the trainer always computes a batch's groups as soon as they may be trained",
    "trainer.own_process": "a CPU trainer always runs in its own process",
    "trainer.skip_zero_advantage": "samples with advantage 0 are always skipped (not with kl_coef > 0)",
    "engines.cpu_kernel": "the compiled CPU decode attention is always used where it builds",
}


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
    schedule: Annotated[ScheduleConfig, _d("steps, batch size, and when to push, evaluate and save")] = (
        _sec(ScheduleConfig)
    )
    tools: Annotated[ToolsConfig, _d("tools of rollout.workflow: multi_turn_tools")] = _sec(ToolsConfig)
    logging: Annotated[LoggingConfig, _d("where metrics go besides run_dir/metrics.jsonl")] = _sec(LoggingConfig)
    judge: Annotated[JudgeConfig, _d("a reward model served by its own engines (the judge service)")] = _sec(JudgeConfig)
