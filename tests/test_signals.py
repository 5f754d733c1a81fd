"""A signal stops any command within seconds at any point of its startup, and a process killed while
it builds the CPU kernel leaves nothing that blocks the next one (torch's build lock file)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO, STREAMRL

from streamrl.engine import kernels


def _wait_for(cond, timeout: float, p: subprocess.Popen) -> None:  # noqa: ANN001
    """Until `cond()`; a command that exits first or a wait that times out fails the test, and the
    command is killed (nothing of it outlives the test)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            raise AssertionError(f"exited early ({p.returncode}): {p.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            p.kill()
            p.communicate()
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def _stop(p: subprocess.Popen, sig: int, within: float) -> tuple[float, str]:
    t0 = time.monotonic()
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    return time.monotonic() - t0, err


def test_a_torch_lock_left_by_a_dead_build_is_removed_and_a_live_build_is_waited_for(tmp_path: Path) -> None:
    build = tmp_path / "ext"
    build.mkdir()
    (build / "lock").touch()  # what torch leaves when a build is killed: it would wait on it forever
    with kernels.build_lock(build):
        assert not (build / "lock").exists()
    holder = subprocess.Popen(["python3", "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.5)",
                               str(build / "streamrl.lock")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"  # a live build elsewhere
    (build / "lock").touch()  # its torch lock: not touched while it lives
    t0 = time.monotonic()
    with kernels.build_lock(build):
        waited = time.monotonic() - t0
        assert holder.poll() is not None  # only once the holder is gone
    assert waited >= 0.5 and not (build / "lock").exists()
    with open(build / "streamrl.lock", "a") as f:  # and released: anyone may take it now
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.slow
def test_a_build_killed_midway_does_not_block_the_next_and_sigterm_stops_one_at_once(
    tmp_path: Path, tiny_model_dir: Path,
) -> None:
    """`streamrl generate` on an empty torch extension folder builds the kernel: SIGKILL mid-build
    leaves torch's lock file; the next one removes it and builds (where it used to wait forever), and
    SIGTERM mid-build ends it within seconds, one line."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    cmd = [*STREAMRL, "generate", "--model", str(tiny_model_dir), "--prompt", "12+34=", "--device", "cpu"]

    def building() -> bool:
        return any((tmp_path / "ext").glob("streamrl_decode_attention_*/lock"))

    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(building, 120, p)
    p.kill()
    p.wait(30)
    [lock] = (tmp_path / "ext").glob("streamrl_decode_attention_*/lock")  # what a killed build leaves behind
    dead = lock.stat().st_ino, lock.stat().st_mtime_ns

    def building_again() -> bool:  # the dead build's lock removed, and a new build under way
        try:
            return (lock.stat().st_ino, lock.stat().st_mtime_ns) != dead
        except FileNotFoundError:
            return False

    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(building_again, 120, p)
    seconds, err = _stop(p, signal.SIGTERM, 10)
    assert seconds < 10 and p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
    assert "removing the lock of an interrupted kernel build" in err


def test_sigterm_during_a_warm_start_stops_the_run_at_once_and_leaves_no_half_folder(tmp_path: Path) -> None:
    """Synchronous work holds the event loop for minutes in a warm start: the signal still ends it in
    seconds, with the one-line message, and no half-trained folder stays in the cache."""
    cache = tmp_path / "cache"
    cmd = [*STREAMRL, "run", str(REPO / "configs" / "quickstart.yaml"), "--no-progress",
           "--set", f"run_dir={tmp_path / 'run'}", "--set", f"model.path={tmp_path / 'model'}",
           "--set", f"warm_start.cache_dir={cache}", "--set", "warm_start.steps=100000", "--set", "warm_start.device=cpu"]
    out = tmp_path / "stdout"
    with out.open("w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    _wait_for(lambda: "warm start: 100000 supervised steps" in out.read_text(), 120, p)
    time.sleep(2.0)  # well inside the training loop
    seconds, err = _stop(p, signal.SIGTERM, 10)
    assert seconds < 10, f"took {seconds:.1f} s"
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
    assert not list(cache.glob(".tmp-*")) and not list(cache.glob("warm-*"))


def test_sigint_during_engine_startup_stops_streamrl_serve(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`streamrl serve` interrupted while its engine loads: out within seconds, one line."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}  # a kernel build: seconds of startup
    p = subprocess.Popen([*STREAMRL, "serve", "--model", str(tiny_model_dir), "--port", "0", "--device", "cpu"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: any((tmp_path / "ext").glob("*/lock")), 120, p)
    seconds, err = _stop(p, signal.SIGINT, 10)
    assert seconds < 10 and p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-2000:]
