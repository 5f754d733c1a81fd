"""Helpers shared by test modules that drive the `streamrl` CLI as a child process."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

# The installed console script, as a user runs it (`pip install -e .` puts it beside the interpreter).
STREAMRL = [str(Path(sys.executable).parent / "streamrl")]
REPO = Path(__file__).parents[1]


def quickstart_until_first_step(tmp_path: Path, *sets: str, timeout: float = 120) -> tuple[subprocess.Popen, Path, Path]:
    """The quickstart on a fresh tiny model (no warm start), started in the background; returns once
    its first training step is in metrics.jsonl."""
    import time

    from streamrl.tasks import build_tiny_model

    model = build_tiny_model(tmp_path / "m", preset="tiny")
    run_dir = tmp_path / "run"
    cmd = [*STREAMRL, "run", str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"), "--no-progress",
           "--set", f"run_dir={run_dir}", "--set", f"model.path={model}", "--set", "model.init=none",
           "--set", "warm_start.enabled=false"]
    for item in sets:
        cmd += ["--set", item]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + timeout
    while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
        assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
        time.sleep(0.5)
    return p, run_dir, model


def sigterm_and_expect_interrupted(p: subprocess.Popen) -> None:
    import signal

    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted"


def processes_mentioning(needle: bytes) -> list[bytes]:
    import os

    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in cmdline:
            found.append(cmdline)
    return found


@contextlib.contextmanager
def running_vllm_server(python: str, model_dir: Path, log: Path, **kw: object) -> Iterator[str]:
    """A real vLLM server started with streamrl's own command line (VLLMServer) by plain subprocess,
    so that module-scoped fixtures do not tie it to one event loop. Yields its URL."""
    import os
    import time
    import urllib.request

    from streamrl.engine.vllm import VLLMServer

    spec = VLLMServer(python, str(model_dir), log_path=log, cache_dir=str(REPO / ".cache" / "vllm"), **kw)  # type: ignore[arg-type]
    with log.open("ab") as out:
        proc = subprocess.Popen(spec.cmd, env=spec.env, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(spec.url + "/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "vLLM did not start in 600 s"
                time.sleep(0.5)
        yield spec.url
    finally:
        os.killpg(proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)  # whatever of the group outlived its leader
        proc.wait()


def run_quickstart_cli(run_dir: Path, *sets: str, cwd: Path, timeout: float = 1200) -> subprocess.CompletedProcess:
    """The README's quickstart command with the warm start cached in the checkout (built once, shared
    by every test and run that asks for the same recipe), plus `--set` overrides."""
    cmd = [*STREAMRL, "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress",
           "--set", f"run_dir={run_dir}", "--set", f"model.path={REPO / '.cache' / 'streamrl' / 'tiny-model'}",
           "--set", f"warm_start.cache_dir={REPO / '.cache' / 'streamrl'}"]
    for item in sets:
        cmd += ["--set", item]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
