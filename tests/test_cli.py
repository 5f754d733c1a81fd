"""The `streamrl` command as a user meets it: config errors are one line and exit 2, help works."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import (
    REPO,
    STREAMRL,
    processes_mentioning,
    quickstart_until_first_step,
    sigterm_and_expect_interrupted,
)

BAD_CONFIGS: list[tuple[str, list[str], str]] = [
    ("schedule:\n  batch_groups: 0\n", [], "schedule.batch_groups"),
    ("schedule:\n  steps: -3\n", [], "schedule.steps"),
    ("trainer:\n  stepz: 3\n", [], "trainer.stepz"),
    ("trainer:\n  steps: 3\n", [], "trainer.steps: renamed to schedule.steps"),
    ("", ["trainer.clip_eps=0"], "trainer.clip_eps"),
    ("", ["trainer.behav_imp_weight_cap=0.5"], "trainer.behav_imp_weight_cap"),
    ("", ["rollout.top_k=0"], "rollout.top_k"),
    ("engines:\n  pool: grpc\n", [], "engines.pool"),
    ("engines:\n  num_replicas: two\n", [], "engines.num_replicas"),
    ("controller:\n  max_staleness: -1\n", [], "controller.max_staleness"),
    ("controller:\n  max_offpolicy_fraction: 1.5\n", [], "controller.max_offpolicy_fraction"),
    ("model:\n  path: /nonexistent/model\n  init: none\n", [], "model.path"),
    ("data:\n  reward: not_a_spec\n", [], "data.reward"),
    ("rollout:\n  temperature: hot\n", [], "rollout.temperature"),
    ("trainer: [1, 2\n", [], "invalid YAML"),
    ("", ["trainer.nope=1"], "trainer.nope"),
    ("", ["trainer.lr=0"], "trainer.lr"),
    ("engines:\n  pool: http\n  router: http://127.0.0.1:1\n", [], "engines.urls"),
    ("data:\n  path: /nonexistent.jsonl\n", [], "data"),
    ("data:\n  reward: no_such_module_xyz:score\n", [], "data.reward"),
    ("data:\n  reward: json:no_such_function\n", [], "data.reward"),
    ("engines:\n  engine: sglang\n", [], "engines.engine"),
    ("engines:\n  stream_interval: 0\n", [], "engines.stream_interval"),
    ("engines:\n  backend: vllm\n", [], "engines.backend"),
]


@pytest.mark.parametrize(("text", "sets", "key"), BAD_CONFIGS)
def test_bad_config_is_one_line_exit_2(tmp_path: Path, text: str, sets: list[str], key: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    cmd = [*STREAMRL, "run", str(cfg), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error:"), p.stderr
    assert key in lines[0]
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists()  # stopped before any work


def test_missing_config_file() -> None:
    p = subprocess.run([*STREAMRL, "run", "/no/such.yaml"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no such file" in p.stderr and "Traceback" not in p.stderr


def test_run_help_and_config_reference() -> None:
    p = subprocess.run([*STREAMRL, "run", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--set" in p.stdout
    p = subprocess.run([*STREAMRL, "config"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for key in ("run_dir", "model.path", "engines.pool", "engines.num_replicas", "controller.max_staleness",
                "schedule.steps", "trainer.clip_eps"):
        assert f"{key}:" in p.stdout
    # docs/config.md's key list is this output, so a key added to the schema shows up there too
    doc = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    listed = doc[doc.index("```text\n") + 8:doc.index("\n```", doc.index("```text\n"))]
    assert listed == p.stdout.strip("\n"), "docs/config.md is out of date: paste `streamrl config` into it"


def test_quickstart_config_is_valid() -> None:
    from streamrl.config import load_config

    cfg = load_config(str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"), check_paths=False)
    assert cfg.model.init == "tiny" and cfg.schedule.steps >= 100


@pytest.mark.parametrize("item", ["trainer.clip_eps=0", "trainer.behav_imp_weight_cap=0.5", "trainer.clip_eps=1.5",
                                  "schedule.push_every=9"])
def test_quickstart_with_a_bad_value_stops_before_the_warm_start(tmp_path: Path, item: str) -> None:
    """The README's command with one out-of-range value: one line naming the key, exit 2, and no work
    done (no warm start: its cache is not even created)."""
    cache = tmp_path / "cache"
    p = subprocess.run([*STREAMRL, "run", str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"),
                        "--set", item, "--set", f"warm_start.cache_dir={cache}", "--set", f"run_dir={tmp_path / 'run'}",
                        "--set", f"model.path={tmp_path / 'model'}"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"config error: {item.split('=')[0]}: ")
    assert not cache.exists() and not (tmp_path / "run").exists() and not (tmp_path / "model").exists()


def test_serve_through_the_console_script(tmp_path: Path) -> None:
    """`streamrl serve --model DIR --port 0` as docs/http.md writes it: it starts, answers, stops on SIGTERM;
    `streamrl serve --help` lists its options."""
    import json
    import signal
    import urllib.request

    from streamrl.tasks import build_tiny_model

    h = subprocess.run([*STREAMRL, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert h.returncode == 0 and "--model" in h.stdout and "--api-key" in h.stdout
    model = build_tiny_model(tmp_path / "m", preset="tiny")
    p = subprocess.Popen([*STREAMRL, "serve", "--model", str(model), "--port", "0", "--device", "cpu"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        while "listening on" not in line:
            assert line, "the server exited before listening"
            line = p.stdout.readline()
        url = line.rsplit(" ", 1)[-1].strip()
        req = urllib.request.Request(url + "/generate", data=json.dumps(
            {"text": "12+34=", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["meta_info"]["completion_tokens"] >= 1
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    assert p.returncode == 0


def test_init_model_and_generate(tmp_path: Path) -> None:
    p = subprocess.run([*STREAMRL, "init-model", str(tmp_path / "m")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "model.safetensors").is_file()
    p = subprocess.run(
        [*STREAMRL, "generate", "--model", str(tmp_path / "m"), "--prompt", "12+34=", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "'12+34=' ->" in p.stdout


def test_sigterm_stops_run_and_its_engine_servers(tmp_path: Path) -> None:
    """A run with launched `streamrl serve` processes and a router, stopped by SIGTERM mid-way:
    exit status 130, one line, no process left behind."""
    p, run_dir, model = quickstart_until_first_step(tmp_path, "engines.pool=http", "engines.router=launch")
    sigterm_and_expect_interrupted(p)
    assert not processes_mentioning(b"sglang::router")
    assert not processes_mentioning(str(model).encode())
    assert (run_dir / "logs" / "engine-0.log").is_file()


def test_sigterm_stops_a_ray_serve_run_and_its_ray_session(tmp_path: Path) -> None:
    """The same with `engines.pool: ray_serve` (this module's one Ray session, in the child process):
    Ray's own SIGTERM handler must not kill the run before it shuts Serve and Ray down."""
    import os
    import time

    p, run_dir, _ = quickstart_until_first_step(tmp_path, "engines.pool=ray_serve", "engines.num_replicas=2")
    ray_dir = os.path.realpath(run_dir / "ray")  # a short folder in /tmp when the run path is long
    assert processes_mentioning(ray_dir.encode()), "the Ray session should be running under the run folder"
    sigterm_and_expect_interrupted(p)
    deadline = time.monotonic() + 10
    while processes_mentioning(ray_dir.encode()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(ray_dir.encode())


def test_unreachable_ray_address_is_one_clear_line(tmp_path: Path) -> None:
    from streamrl.tasks import build_tiny_model

    model = build_tiny_model(tmp_path / "m", preset="tiny")
    p = subprocess.run(
        [*STREAMRL, "run", str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"), "--no-progress",
         "--set", f"run_dir={tmp_path / 'run'}", "--set", f"model.path={model}", "--set", "model.init=none",
         "--set", "warm_start.enabled=false", "--set", "engines.pool=ray_serve",
         "--set", "engines.ray_address=127.0.0.1:9"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("error: engines.ray_address: no Ray cluster answers at")
    assert "Traceback" not in p.stderr


def test_ray_that_cannot_start_is_one_clear_line(tmp_path: Path) -> None:
    from streamrl.tasks import build_tiny_model

    model = build_tiny_model(tmp_path / "m", preset="tiny")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ray").write_text("a file where Ray's temp folder goes")
    p = subprocess.run(
        [*STREAMRL, "run", str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"), "--no-progress",
         "--set", f"run_dir={run_dir}", "--set", f"model.path={model}", "--set", "model.init=none",
         "--set", "warm_start.enabled=false", "--set", "engines.pool=ray_serve"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1].startswith("error: Ray's temp folder")
    assert "Traceback" not in p.stderr


def _children(pid: int) -> list[int]:
    kids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(proc.name))
    return kids


def test_a_trainer_killed_mid_run_is_one_line_exit_1(tmp_path: Path) -> None:
    """The trainer is a child process of the run: killed by the OOM killer (SIGKILL) mid-run, the run
    stops with one line naming the signal, no traceback, and leaves no process behind."""
    import os
    import signal

    p, _, model = quickstart_until_first_step(tmp_path)
    trainer = [k for k in _children(p.pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert len(trainer) == 1, trainer
    os.kill(trainer[0], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == f"error: the trainer process (pid {trainer[0]}) was killed by SIGKILL"
    assert "Traceback" not in err
    assert not processes_mentioning(str(model).encode())


def test_a_command_shows_streamrls_progress_and_none_of_transformers_bars(tmp_path: Path) -> None:
    """Building a model, loading it in the engine and the trainer: transformers' own bars ("Loading
    weights", "Writing model shards") stay out of what a user sees, in every process of the run."""
    p = subprocess.run([*STREAMRL, "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress",
                        "--set", f"run_dir={tmp_path / 'run'}", "--set", f"model.path={tmp_path / 'model'}",
                        "--set", "warm_start.enabled=false", "--set", "schedule.steps=2", "--set", "data.eval_size=8"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout + p.stderr
    assert "building tiny model" in out and "held-out accuracy" in out
    assert "Loading weights" not in out and "Writing model shards" not in out and "it/s]" not in out, out[-2000:]
