"""Config: defaults, YAML + --set overrides, one-line errors that name the key, dump round-trip."""

from pathlib import Path

import pytest

from streamrl.config import Config, ConfigError, describe_config, dump_config, load_config


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def error_of(path: str | None, overrides: list[str] = ()) -> str:  # type: ignore[assignment]
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("config error: ")
    return msg


def test_defaults_load() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.run_dir == "runs/quickstart" and cfg.seed == 0
    assert cfg.model.init == "tiny"
    assert cfg.data.task == "addition" and cfg.data.path is None
    assert cfg.engines.pool == "local" and cfg.engines.urls == []
    assert cfg.rollout.group_size == 8 and cfg.trainer.lr == 3e-5
    assert cfg.buffer.priority == "oldest_version" and cfg.controller.max_staleness == 0


def test_empty_file_and_empty_section_are_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "# nothing\nrollout:\n", "b.yaml")) == Config()


def test_yaml_and_overrides(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    path = write(
        tmp_path,
        f"run_dir: {tmp_path}/run\nmodel:\n  path: {model}\n  init: none\n"
        "rollout:\n  temperature: 0.5\n  group_size: 4\ntrainer:\n  lr: 1e-4\nschedule:\n  steps: 3\n",
    )
    cfg = load_config(
        path,
        [
            "rollout.temperature=0.7",
            "engines.pool=http",
            "engines.urls=[http://a:8000,http://b:8000]",
            "data.reward=null",
            "controller.max_staleness=2",
            "model.init_seed=7",
        ],
    )
    assert cfg.model.path == str(model) and cfg.model.init == "none" and cfg.model.init_seed == 7
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.group_size == 4
    assert cfg.trainer.lr == 1e-4 and isinstance(cfg.trainer.lr, float)  # YAML 1.1 reads 1e-4 as a string
    assert cfg.engines.urls == ["http://a:8000", "http://b:8000"]
    assert cfg.data.reward is None and cfg.controller.max_staleness == 2


def test_override_conveniences() -> None:
    cfg = load_config(None, ["run_dir=123", "engines.pool=http", "engines.urls=http://a"])
    assert cfg.run_dir == "123"  # a string field takes the text as written
    assert cfg.engines.urls == ["http://a"]  # a lone value for a list field is a one-item list
    assert load_config(None, ["trainer.lr=1"]).trainer.lr == 1.0


def test_data_path(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = load_config(None, ["data.task=null", f"data.path={data}", "data.reward=my_pkg.rewards:score"])
    assert cfg.data.path == str(data) and cfg.data.reward == "my_pkg.rewards:score"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["engines.pol=http"], "config error: engines.pol: unknown key (did you mean engines.pool?)"),
        (
            ["trainer.temperature=1"],
            "config error: trainer.temperature: unknown key (did you mean rollout.temperature?)",
        ),
        (["modle.path=x"], "config error: modle: unknown key (did you mean model?)"),
        (["schedule.steps=abc"], "config error: schedule.steps: expected int, got 'abc'"),
        (["schedule.steps=0"], "config error: schedule.steps: expected int >= 1, got 0"),
        (["schedule.batch_groups=0"], "config error: schedule.batch_groups: expected int >= 1, got 0"),
        (["trainer.ppo_minibatches=0"], "config error: trainer.ppo_minibatches: expected int >= 1, got 0"),
        (
            ["controller.max_staleness=-1"],
            "config error: controller.max_staleness: expected int >= 0, got -1",
        ),
        (
            ["controller.max_offpolicy_fraction=1.5"],
            "config error: controller.max_offpolicy_fraction: expected float <= 1.0, got 1.5",
        ),
        (["rollout.top_p=0"], "config error: rollout.top_p: expected float > 0.0, got 0"),
        (
            ["engines.pool=grpc"],
            "config error: engines.pool: expected one of 'local', 'ray_serve', 'http', got 'grpc'",
        ),
        (
            ["trainer.loss=ppo"],
            "config error: trainer.loss: expected one of 'grpo', 'decoupled_ppo', 'tis', got 'ppo'",
        ),
        (
            ["data.reward=not_a_spec"],
            "config error: data.reward: expected 'math', 'judge', 'module:function' or 'file.py:function', got 'not_a_spec'",
        ),
        (
            ["engines.pool=http", "engines.router=http://127.0.0.1:1"],
            "config error: engines.urls: a router needs the worker URLs too (control calls go to every worker)",
        ),
        (
            ["engines.pool=http", "engines.urls=[ftp://x]"],
            "config error: engines.urls[0]: expected an http:// or https:// URL, got 'ftp://x'",
        ),
        (["engines.urls=[1]"], "config error: engines.urls[0]: expected str, got 1"),
        (
            ["data.path=p.jsonl"],
            "config error: data.path: data.task and data.path are both set; set exactly one (e.g. data.task=null)",
        ),
        (
            ["data.task=null"],
            "config error: data.task: neither data.task nor data.path is set; set exactly one",
        ),
        (["data.task=additon"], "config error: data.task: unknown task 'additon' (did you mean addition?)"),
        (
            ["data.task=null", "data.path=missing.jsonl"],
            "config error: data.path: file 'missing.jsonl' does not exist",
        ),
        (
            ["engines.max_total_tokens=4", "rollout.max_new_tokens=8"],
            "config error: engines.max_total_tokens: must be >= rollout.max_new_tokens (8), got 4",
        ),
        (
            ["buffer.capacity=2"],
            "config error: buffer.capacity: must be >= schedule.batch_groups (8) or no batch can fill, got 2",
        ),
        (["trainer=5"], "config error: trainer: expected a mapping of trainer settings, got 5"),
        (
            ["schedule.steps.x=1"],
            "config error: schedule.steps: is a value, not a section; cannot set schedule.steps.x",
        ),
        (["oops"], "config error: --set oops: expected key=value, e.g. --set rollout.temperature=0.7"),
        (["warm_start.enabled=maybe"], "config error: warm_start.enabled: expected bool, got 'maybe'"),
        (
            ["controller.max_staleness=1", "schedule.push_every=3"],
            "config error: schedule.push_every: must be <= controller.max_staleness + 1 (2): between two pushes "
            "the engines lag the trainer by up to push_every - 1 versions, and no group may start more than "
            "max_staleness versions before it is trained; got 3",
        ),
        (
            ["rollout.partial=keep"],
            "config error: rollout.partial: expected one of 'resume', 'discard', 'retract', 'in_place', got 'keep'",
        ),
        (
            ["engines.pool=http", "engines.backend=vllm", "rollout.partial=retract"],
            "config error: rollout.partial: 'retract' needs the streamrl engine or SGLang; "
            "with vLLM servers use resume or discard",
        ),
        (
            ["trainer.behav_imp_weight_cap=-1"],
            "config error: trainer.behav_imp_weight_cap: expected float > 1.0, got -1",
        ),
    ],
)
def test_override_errors(overrides: list[str], expected: str) -> None:
    assert error_of(None, overrides) == expected


def test_missing_model_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    msg = error_of(None, ["model.init=none", f"model.path={missing}"])
    assert msg.startswith(f"config error: model.path: folder '{missing}' does not exist")
    # init=tiny builds it, so a missing folder is fine; check_paths=False skips the filesystem entirely
    assert load_config(None, [f"model.path={missing}"]).model.path == str(missing)
    assert (
        load_config(None, ["model.init=none", f"model.path={missing}"], check_paths=False).model.init
        == "none"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("engines:\n  pol: http\n", "config error: engines.pol: unknown key (did you mean engines.pool?)"),
        ("rollout:\n  temperature: hot\n", "config error: rollout.temperature: expected float, got 'hot'"),
        ("schedule:\n  batch_groups: 0\n", "config error: schedule.batch_groups: expected int >= 1, got 0"),
        ("schedule:\n  steps: 1.5\n", "config error: schedule.steps: expected int, got 1.5"),
        (
            "engines:\n  dtype: fp8\n",
            "config error: engines.dtype: expected one of 'float32', 'bfloat16', 'float16', got 'fp8'",
        ),
        ("trainer:\n  steps: 3\n", "config error: trainer.steps: renamed to schedule.steps"),
        ("model:\n  device: cpu\n", "config error: model.device: renamed to engines.device"),
        ("trainer:\n  stream_batch: false\n", "config error: trainer.stream_batch: removed: the trainer always "
                                                 "computes a batch's groups as soon as they may be trained"),
        (
            "warm_start:\n  label_noise: 2\n",
            "config error: warm_start.label_noise: expected float <= 1.0, got 2",
        ),
        ("- a\n- b\n", "expected a mapping of sections at top level, got list"),
    ],
)
def test_file_errors(tmp_path: Path, text: str, expected: str) -> None:
    assert error_of(write(tmp_path, text)).endswith(expected)


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer:\n  lr: 3\n  loss: [1, 2\nrollout: {}\n")
    msg = error_of(path)
    assert msg.startswith(f"config error: {path}: invalid YAML at line ")


def test_missing_file(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.yaml")
    assert error_of(path) == f"config error: {path}: no such file"


def test_dump_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        ["engines.pool=http", "engines.urls=[http://a:1]", "trainer.lr=2e-5", "buffer.capacity=16", "seed=3"],
    )
    text = dump_config(cfg)
    assert load_config(write(tmp_path, text)) == cfg
    assert load_config(write(tmp_path, dump_config(Config()), "d.yaml")) == Config()


def test_describe_lists_every_key() -> None:
    text = describe_config()
    assert "schedule.steps: int = 100  # optimizer steps (one batch each) [>= 1]" in text
    assert 'engines.pool: "local"|"ray_serve"|"http" = "local"' in text
    assert "engines.max_total_tokens: int | null = null" in text
    keys = [line.split(":", 1)[0] for line in text.splitlines() if line and not line.startswith("#")]
    for key in (
        "run_dir",
        "seed",
        "model.path",
        "warm_start.label_noise",
        "data.reward",
        "rollout.partial",
        "controller.stale_policy",
        "buffer.capacity",
        "schedule.save_every",
    ):
        assert key in keys
    assert all("  # " in line for line in text.splitlines() if line and not line.startswith("#"))


def _bounds() -> list[tuple[str, str]]:
    """Every numeric bound of the schema, as (key, the nearest value outside it)."""
    import typing

    import msgspec
    from msgspec import Meta

    def walk(cls: type, prefix: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for name, tp in typing.get_type_hints(cls, include_extras=True).items():
            inner = typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp
            if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
                out += walk(inner, f"{prefix}{name}.")
            else:
                out.append((f"{prefix}{name}", tp))
        return out

    def metas(tp: object) -> tuple[list[Meta], bool]:
        found, whole = [], False
        for a in [tp, *typing.get_args(tp), *[x for u in typing.get_args(tp) for x in typing.get_args(u)]]:
            if typing.get_origin(a) is typing.Annotated:
                found += [m for m in a.__metadata__ if isinstance(m, Meta)]
                whole = whole or typing.get_args(a)[0] is int
        return found, whole

    out = []
    for key, tp in walk(Config, ""):
        found, whole = metas(tp)
        for meta in found:
            for op, val in (("ge", meta.ge), ("gt", meta.gt), ("le", meta.le), ("lt", meta.lt)):
                if val is None:
                    continue
                step = 1 if whole else 1e-3
                bad = {"ge": val - step, "gt": val, "le": val + step, "lt": val}[op]
                out.append((key, str(int(bad) if whole else bad)))
    return sorted(set(out))


BOUNDS = _bounds()


def test_the_bound_list_covers_the_schema() -> None:
    keys = {k for k, _ in BOUNDS}
    # The bounds the issue found unchecked, and one of each kind (ge, gt, le, lt, nullable).
    for key in ("trainer.clip_eps", "trainer.behav_imp_weight_cap", "trainer.tis_cap", "schedule.steps",
                "warm_start.label_noise", "rollout.top_p", "engines.max_total_tokens", "controller.max_staleness"):
        assert key in keys
    assert len(BOUNDS) >= 40


@pytest.mark.parametrize(("key", "bad"), BOUNDS, ids=[f"{k}={v}" for k, v in BOUNDS])
def test_every_bound_rejects_its_bad_value_as_one_config_error(key: str, bad: str) -> None:
    msg = error_of(None, [f"{key}={bad}"])
    assert msg.startswith(f"config error: {key}: expected ") and "\n" not in msg, msg


@pytest.mark.parametrize(("item", "expected"), [
    ("trainer.clip_eps=0", "config error: trainer.clip_eps: expected float > 0.0, got 0"),
    ("trainer.clip_eps=1", "config error: trainer.clip_eps: expected float < 1.0, got 1"),
    ("trainer.behav_imp_weight_cap=0.5", "config error: trainer.behav_imp_weight_cap: expected float > 1.0, got 0.5"),
    ("rollout.top_k=0", "config error: rollout.top_k: expected -1 (off) or >= 1, got 0"),
    ("controller.stale_policy=ignore", "config error: controller.stale_policy: expected one of 'drop', 'keep', "
                                       "got 'ignore'"),
])
def test_values_components_refuse_are_config_errors(item: str, expected: str) -> None:
    """Each value a component would refuse at run time (a loss, the engine's sampler, the controller)
    is refused here first, in the same words for every key."""
    assert error_of(None, [item]) == expected
