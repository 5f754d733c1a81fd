"""`logging.*`: the metrics rows as TensorBoard scalars (and wandb, where installed), read back with
tensorboard's own reader; the config's checks; a sweep's points under one TensorBoard root."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import msgspec
import pytest
from helpers import REPO, STREAMRL
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_run import read_metrics, small_cfg

from streamrl.config import Config, ConfigError, LoggingConfig, config_from_dict, load_config
from streamrl.logging_sinks import MetricSinks, TensorBoardSink, scalars
from streamrl.sweep import parse_grid, plan

ROWS = [
    {"step": 1, "version": 1, "reward_mean": 0.25, "loss": -0.5, "logprob_mismatch": None, "batch_parts": 2,
     "colocated": True, "note": "text", "controller": [{"event": "drop", "n": 1}], "pool": {"busy_s": 1.5}},
    {"step": 2, "version": 2, "reward_mean": 0.5, "loss": -0.25, "logprob_mismatch": 1e-6, "batch_parts": 1,
     "colocated": False, "note": "more", "controller": [], "pool": {"busy_s": 3.0}},
    {"step": 3, "version": 3, "reward_mean": 0.75, "loss": 0.125, "logprob_mismatch": None, "batch_parts": 1,
     "colocated": False, "note": "", "controller": [], "pool": {"busy_s": 4.5}},
]


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in `logdir`'s event files as [(step, value)], through TensorBoard's reader."""
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_rows_become_scalars_at_their_step(tmp_path: Path) -> None:
    sinks = MetricSinks(LoggingConfig(tensorboard=True), tmp_path)
    for row in ROWS:
        sinks.write(row)
    sinks.close()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    got = read_scalars(tmp_path / "tensorboard")
    # numbers (bools as 0/1), a nested mapping as outer/inner; strings, lists and nulls are left out
    assert set(got) == {"version", "reward_mean", "loss", "batch_parts", "colocated", "pool/busy_s",
                        "logprob_mismatch"}
    for tag in ("version", "reward_mean", "loss", "batch_parts", "pool/busy_s"):
        key, inner = tag.split("/") if "/" in tag else (tag, None)
        want = [(r["step"], r[key][inner] if inner else r[key]) for r in ROWS]
        assert got[tag] == [(s, pytest.approx(v, rel=1e-6)) for s, v in want], tag
    assert got["colocated"] == [(1, 1.0), (2, 0.0), (3, 0.0)]
    assert got["logprob_mismatch"] == [(2, pytest.approx(1e-6, rel=1e-6))]  # only the step that had one


def test_a_resumed_run_replaces_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    """A run killed after step 3, resumed from its step-1 checkpoint: TensorBoard shows steps 2 and 3 of
    the resumed run, not of the lost one (its first row starts a new session)."""
    first = MetricSinks(LoggingConfig(tensorboard=True), tmp_path)
    for step in (1, 2, 3):
        first.write({"step": step, "reward_mean": float(step)})
    first.close()
    resumed = MetricSinks(LoggingConfig(tensorboard=True), tmp_path)
    for step in (2, 3, 4):
        resumed.write({"step": step, "reward_mean": 10.0 * step})
    resumed.close()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    assert read_scalars(tmp_path / "tensorboard")["reward_mean"] == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]


def test_scalars_flattens_and_skips() -> None:
    assert scalars({"a": 1, "b": 2.5, "c": "x", "d": [1, 2], "e": None, "f": {"g": 3, "h": {"i": True}}}) == {
        "a": 1.0, "b": 2.5, "f/g": 3.0, "f/h/i": 1.0}


def test_tensorboard_dir_and_no_sinks(tmp_path: Path) -> None:
    elsewhere = tmp_path / "tb" / "point"
    sinks = MetricSinks(LoggingConfig(tensorboard=True, tensorboard_dir=str(elsewhere)), tmp_path / "run")
    sinks.write(ROWS[0])
    sinks.close()
    assert read_scalars(elsewhere)["reward_mean"] == [(1, 0.25)]
    assert not (tmp_path / "run" / "tensorboard").exists()
    for off in (None, LoggingConfig()):  # the default: metrics.jsonl only
        quiet = MetricSinks(off, tmp_path / "quiet")
        quiet.write(ROWS[0])
        quiet.close()
        assert quiet.sinks == [] and not (tmp_path / "quiet").exists()


def test_a_sink_flushes_as_the_run_goes(tmp_path: Path) -> None:
    """The curves are there while the run is (flush_secs), not only at its end."""
    import time

    sink = TensorBoardSink(tmp_path, flush_secs=0.2)
    sink.write(7, {"reward_mean": 0.5})
    deadline = time.monotonic() + 10
    while not read_scalars(tmp_path).get("reward_mean") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert read_scalars(tmp_path)["reward_mean"] == [(7, 0.5)]
    sink.close()


def test_wandb_gets_the_rows_and_the_run_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a stand-in `wandb` module (the real one is not a dependency): init with the project, the
    run folder, the mode and the run's config as plain data; a log per row at its step; finish at close."""
    import sys
    import types

    calls: list[tuple] = []

    class FakeRun:
        def log(self, values: dict, step: int) -> None:
            calls.append(("log", values, step))

        def finish(self) -> None:
            calls.append(("finish",))

    def init(**kwargs) -> FakeRun:
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = Config(logging=LoggingConfig(wandb=True, wandb_project="eta"))
    sinks = MetricSinks(cfg.logging, tmp_path / "run", run_config=cfg)
    for row in ROWS[:2]:
        sinks.write(row)
    sinks.close()
    (_, init_kw), *logs, end = calls
    assert init_kw == {"project": "eta", "dir": str(tmp_path / "run"), "mode": "offline", "name": "run",
                       "config": msgspec.to_builtins(cfg)}
    assert init_kw["config"]["logging"]["wandb_project"] == "eta"
    assert [(step, values["reward_mean"]) for _, values, step in logs] == [(1, 0.25), (2, 0.5)]
    assert "note" not in logs[0][1] and logs[0][1]["pool/busy_s"] == 1.5 and end == ("finish",)


def test_the_config_check_passes_with_tensorboard_on() -> None:
    cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), ["logging.tensorboard=true"], check_paths=False)
    assert cfg.logging == LoggingConfig(tensorboard=True) and Config().logging == LoggingConfig()
    p = subprocess.run([*STREAMRL, "config", "configs/quickstart.yaml", "--set", "logging.tensorboard=true",
                        "--set", "logging.tensorboard_dir=runs/tb"], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "logging.tensorboard: bool = true  #" in p.stdout
    assert 'logging.tensorboard_dir: str | null = "runs/tb"  #' in p.stdout


def test_wandb_without_wandb_is_one_config_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        config_from_dict({"logging": {"wandb": True}}, check_paths=False)
    assert str(e.value) == ("config error: logging.wandb: the wandb package is not installed (pip install wandb), "
                            "or set logging.wandb=false")
    with pytest.raises(ConfigError, match="logging.wandb_mode: expected one of 'offline', 'online'"):
        config_from_dict({"logging": {"wandb_mode": "cloud"}}, check_paths=False)


def test_wandb_through_the_console_script(tmp_path: Path) -> None:
    """`streamrl run` with logging.wandb: one line, exit 2, before any work, where wandb is missing."""
    p = subprocess.run([*STREAMRL, "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress",
                        "--set", f"run_dir={tmp_path / 'run'}", "--set", "logging.wandb=true",
                        "--set", "warm_start.enabled=false", "--set", f"model.path={tmp_path / 'm'}",
                        "--set", "schedule.steps=1", "--set", "data.eval_size=8"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if importlib.util.find_spec("wandb") is not None:  # installed: an offline run under run_dir/wandb
        assert p.returncode == 0, p.stderr[-3000:]
        assert (tmp_path / "run" / "wandb").is_dir()
        return
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "config error: logging.wandb: the wandb package is not installed (pip install wandb), "
        "or set logging.wandb=false"], p.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "m").exists()  # no model built, no warm start


def test_sweep_points_share_one_tensorboard_root(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = tmp_path / "base.yaml"
    cfg.write_text(json.dumps(small_cfg(tmp_path, tiny_model_dir, logging={"tensorboard": True})))
    out = tmp_path / "sweep"
    grid = parse_grid(["controller.max_staleness=0,2", "rollout.partial=resume,discard"])
    points = plan(str(cfg), grid, [], out)
    dirs = [Path(c.logging.tensorboard_dir) for _, _, c in points]
    assert [d.name for d in dirs] == [name for name, _, _ in points] and len(set(dirs)) == 4
    assert {d.parent for d in dirs} == {out / "tensorboard"}  # `tensorboard --logdir SWEEP/tensorboard`
    assert all(c.logging.tensorboard for _, _, c in points)

    # a tensorboard_dir of the base config is the root; without logging.tensorboard nothing is set
    points = plan(str(cfg), grid, [f"logging.tensorboard_dir={tmp_path / 'tb'}"], out)
    assert {Path(c.logging.tensorboard_dir).parent for _, _, c in points} == {tmp_path / "tb"}
    points = plan(str(cfg), grid, ["logging.tensorboard=false"], out)
    assert all(c.logging.tensorboard_dir is None for _, _, c in points)


async def test_a_sweeps_points_are_runs_of_one_tensorboard(tmp_path: Path, tiny_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`tensorboard --logdir SWEEP/tensorboard` sees one run per point, named by it (each point's run
    stood in for by one writing its rows as a real run's StepMetrics would)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    import streamrl.run as run_mod
    from streamrl.sweep import sweep

    async def fake_run(cfg: Config, **_) -> dict:
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True)
        eta = cfg.controller.max_staleness
        rows = [{"step": s, "reward_mean": s / 10 + eta, "engine_idle_frac": 0.5, "staleness_max": eta,
                 "wall_s": float(s), "samples": 8 * s} for s in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        sinks = MetricSinks(cfg.logging, run_dir)
        for r in rows:
            sinks.write(r)
        sinks.close()
        return {"train_wall_s": 2.0, "samples": 16, "eval_after": {"sampled": 0.5, "greedy": 0.5}}

    monkeypatch.setattr(run_mod, "run", fake_run)
    cfg = tmp_path / "base.yaml"
    cfg.write_text(json.dumps(small_cfg(tmp_path, tiny_model_dir, logging={"tensorboard": True})))
    out, said = tmp_path / "sweep", []
    result = await sweep(str(cfg), ["controller.max_staleness=0,2"], out=out, show_progress=False, log=said.append)
    assert result["tensorboard"] == str(out / "tensorboard")
    assert f"sweep: curves with `tensorboard --logdir {out / 'tensorboard'}`" in said
    mux = EventMultiplexer().AddRunsFromDirectory(str(out / "tensorboard"))
    mux.Reload()
    assert sorted(mux.Runs()) == ["max_staleness=0", "max_staleness=2"]
    for name, eta in (("max_staleness=0", 0), ("max_staleness=2", 2)):
        assert [(e.step, e.value) for e in mux.Scalars(name, "reward_mean")] == [
            (1, pytest.approx(0.1 + eta)), (2, pytest.approx(0.2 + eta))]


async def test_a_run_writes_its_rows_to_tensorboard(tmp_path: Path, tiny_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """In process: every metrics.jsonl row of a short run, as scalars in run_dir/tensorboard. (Until run.py
    hands StepMetrics `logging=cfg.logging` itself, the wrapper below does; after, it changes nothing.)"""
    import streamrl.run as run_mod
    from streamrl.metrics import StepMetrics

    cfg = config_from_dict(small_cfg(tmp_path, tiny_model_dir, schedule={"steps": 3, "batch_groups": 2},
                                     logging={"tensorboard": True}))

    def with_logging(*args, **kwargs):
        kwargs.setdefault("logging", cfg.logging)
        return StepMetrics(*args, **kwargs)

    monkeypatch.setattr(run_mod, "StepMetrics", with_logging)
    summary = await run_mod.run(cfg, show_progress=False, log=lambda *_: None)
    rows = read_metrics(Path(summary["run_dir"]))
    got = read_scalars(Path(cfg.run_dir) / "tensorboard")
    assert [s for s, _ in got["reward_mean"]] == [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward_mean", "loss", "samples", "wall_s", "tokens_generated", "staleness_max"):
        assert got[key] == [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-9)) for r in rows], key


def test_quickstart_with_tensorboard_via_cli(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`streamrl run configs/quickstart.yaml --set logging.tensorboard=true`: the event file holds every
    step of metrics.jsonl."""
    run_dir = tmp_path / "run"
    sets = [f"run_dir={run_dir}", f"model.path={tiny_model_dir}", "model.init=none", "warm_start.enabled=false",
            "schedule.steps=2", "schedule.batch_groups=2", "rollout.group_size=4", "data.eval_size=8",
            "logging.tensorboard=true"]
    cmd = [*STREAMRL, "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert (run_dir / "tensorboard").is_dir(), "run.py's build() must hand StepMetrics logging=cfg.logging"
    got = read_scalars(run_dir / "tensorboard")
    assert got["reward_mean"] == [(r["step"], pytest.approx(r["reward_mean"], rel=1e-6)) for r in rows]
    assert [s for s, _ in got["gen_tps"]] == [1, 2]
