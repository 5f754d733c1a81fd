"""The http pool survives its servers: one of two launched `streamrl serve` processes SIGKILLed or
SIGSTOPped mid-run, a given-URL server frozen and thawed, the last server gone. Every step runs once,
0 tokens are discarded, staleness stays bounded, the run learns as without the fault, and a run
with no server left stops with one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import STREAMRL
from test_run import REPO, read_groups, read_metrics, small_cfg

from streamrl.config import EnginesConfig, config_from_dict
from streamrl.engine.args import EngineArgs
from streamrl.rollout.http_pool import HttpPool, launch_servers
from streamrl.run import run
from streamrl.weights import load_folder

FAST_HEALTH = {"health_check_interval_s": 0.3, "health_check_timeout_s": 1.0}
STEPS = 20


def _cfg(tmp_path: Path, model: Path, name: str, **engines) -> dict:
    return small_cfg(
        tmp_path / name, model, controller={"max_staleness": 2},
        rollout={"group_size": 4, "max_new_tokens": 24}, schedule={"steps": STEPS, "batch_groups": 2},
        trainer={"lr": 3e-3}, data={"reward": f"{REPO / 'tests' / 'rewards_for_tests.py'}:length_reward"},
        engines={"pool": "http", "max_running_requests": 8, **FAST_HEALTH, **engines},
    )


def _child_servers() -> list[int]:
    """Pids of the `streamrl serve` processes this test process launched."""
    me, out = os.getpid(), []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == me and b"streamrl.engine.http.server" in (proc / "cmdline").read_bytes():
                out.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(out)


async def _after_steps(run_dir: Path, n: int, timeout: float = 180) -> None:
    t0 = time.monotonic()
    while True:
        f = run_dir / "metrics.jsonl"
        if f.exists() and len(f.read_text().splitlines()) >= n:
            return
        assert time.monotonic() - t0 < timeout, "the run made no progress"
        await asyncio.sleep(0.05)


def _check_run(run_dir: Path) -> list[dict]:
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step, each once
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    assert sum(r["tokens_discarded"] for r in rows) == 0
    assert max(r["staleness_max"] for r in rows) <= 2
    groups = read_groups(run_dir)
    assert len(groups) == STEPS * 2
    rids = set()
    for g in groups:
        assert sorted(s.index for s in g.samples) == [0, 1, 2, 3]
        rids.add(g.group_id)
        for s in g.samples:
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions) and s.finish_reason in ("stop", "length")
    assert len(rids) == len(groups)  # no group trained twice
    return rows


def _late_reward(rows: list[dict]) -> float:
    tail = rows[-4:]
    return sum(r["reward_mean"] for r in tail) / len(tail)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> float:
    tmp = tmp_path_factory.mktemp("baseline")
    cfg = config_from_dict(_cfg(tmp, tiny_model_dir, "base", num_replicas=2))
    asyncio.run(run(cfg, show_progress=False, log=lambda *_: None))
    return _late_reward(_check_run(Path(cfg.run_dir)))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
async def test_a_launched_server_killed_or_frozen_mid_run(tmp_path: Path, tiny_model_dir: Path, baseline: float,
                                                          sig: signal.Signals) -> None:
    cfg = config_from_dict(_cfg(tmp_path, tiny_model_dir, "fault", num_replicas=2))
    task = asyncio.ensure_future(run(cfg, show_progress=False, log=lambda *_: None))
    await _after_steps(Path(cfg.run_dir), 2)
    victims = _child_servers()
    assert len(victims) == 2, victims
    os.killpg(victims[0], sig)  # the server's whole process group, as a crash or a freeze would be
    summary = await asyncio.wait_for(task, 300)
    rows = _check_run(Path(cfg.run_dir))
    assert summary["servers_lost"] >= 1, summary  # its relaunch: test_a_lost_launched_server_is_relaunched...
    assert _late_reward(rows) >= 0.8 * baseline, (rows[-4:], baseline)
    assert victims[0] not in _child_servers()  # the lost server is gone, not left stopped
    assert _child_servers() == []  # and the run stopped its relaunched one


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
async def test_a_lost_launched_server_is_relaunched_with_current_weights(
        tmp_path: Path, tiny_model_dir: Path, tiny_model_dir_b: Path, sig: signal.Signals) -> None:
    """Lost, killed for good, launched again after a backoff, given the weights pushed while it was
    down, and only then routed to: its greedy tokens equal the other server's."""
    servers = launch_servers(2, str(tiny_model_dir), tmp_path, EngineArgs(device="cpu", max_running_requests=8,
                                                                          num_threads=1, weight_version="0"))
    pool = HttpPool(launch=servers, engines=EnginesConfig(health_check_interval_s=0.3, health_check_timeout_s=1.0))
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    async with pool:
        first_pid = servers[0].proc.pid
        os.killpg(first_pid, sig)
        weights = load_folder(tiny_model_dir_b)
        out = await pool.generate_many([[1, 5, 6]] * 4, [greedy] * 4, [f"r{i}" for i in range(4)])
        assert all(len(r["output_ids"]) == 8 or r["meta_info"]["finish_reason"]["type"] == "abort" for r in out)
        await pool.push_weights(weights, 1)  # reaches the server that is up; the lost one catches up
        t0 = time.monotonic()
        while pool.stats()["servers_rejoined"] < 1:
            assert time.monotonic() - t0 < 120, pool.stats()
            await asyncio.sleep(0.2)
        assert pool.stats()["servers_restarted"] == 1 and servers[0].proc.pid != first_pid
        answers = []
        for rep in pool.replicas.all:
            assert (await rep.client.server_info())["weight_version"] == "1"
            answers.append((await rep.client.generate([1, 5, 6], greedy))["output_ids"])
        assert answers[0] == answers[1]
    assert _child_servers() == []


class _Server:
    def __init__(self, model: Path, log: Path) -> None:
        self.p = subprocess.Popen([*STREAMRL, "serve", "--model", str(model), "--port", "0", "--device", "cpu",
                                   "--num-threads", "1", "--weight-version", "0"], stdout=subprocess.PIPE,
                                  stderr=log.open("w"), text=True, start_new_session=True)
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        while "listening on" not in line:
            assert line, log.read_text()
            line = self.p.stdout.readline()
        self.url = line.rsplit(" ", 1)[-1].strip()

    def version(self) -> str:
        with urllib.request.urlopen(self.url + "/get_weight_version", timeout=10) as r:
            return json.loads(r.read())["weight_version"]

    def stop(self) -> None:
        os.killpg(self.p.pid, signal.SIGCONT)
        self.p.terminate()
        self.p.wait(30)


async def test_a_given_server_frozen_then_thawed_rejoins_with_current_weights(tmp_path: Path,
                                                                              tiny_model_dir: Path) -> None:
    servers = [_Server(tiny_model_dir, tmp_path / f"s{i}.log") for i in range(2)]
    try:
        cfg = config_from_dict(_cfg(tmp_path, tiny_model_dir, "given", urls=[s.url for s in servers]))
        task = asyncio.ensure_future(run(cfg, show_progress=False, log=lambda *_: None))
        run_dir = Path(cfg.run_dir)
        await _after_steps(run_dir, 2)
        os.killpg(servers[1].p.pid, signal.SIGSTOP)
        await _after_steps(run_dir, 6)  # the run goes on with one server meanwhile
        os.killpg(servers[1].p.pid, signal.SIGCONT)
        summary = await asyncio.wait_for(task, 300)
        _check_run(run_dir)
        assert summary["servers_lost"] >= 1 and summary["servers_rejoined"] >= 1, summary
        assert [s.version() for s in servers] == [str(STEPS)] * 2  # the thawed one caught up with every push
    finally:
        for s in servers:
            s.stop()


def test_a_run_whose_last_server_is_gone_stops_with_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    server = _Server(tiny_model_dir, tmp_path / "s.log")
    cfg = _cfg(tmp_path, tiny_model_dir, "alone", urls=[server.url], all_lost_timeout_s=3)
    cfg["schedule"]["steps"] = 500
    path = tmp_path / "alone.json"  # YAML is a superset of JSON
    path.write_text(json.dumps(cfg))
    p = subprocess.Popen([*STREAMRL, "run", str(path), "--no-progress"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        metrics = Path(cfg["run_dir"]) / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert p.poll() is None and time.monotonic() - t0 < 180, p.communicate()
            time.sleep(0.1)
        os.killpg(server.p.pid, signal.SIGKILL)
        _, err = p.communicate(timeout=120)
    finally:
        server.stop()
    assert p.returncode == 1, err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert lines[-1].startswith("error: no engine server has answered for 3 s"), err
    assert "Traceback" not in err and any(x.startswith("http pool: engine server") for x in lines), err
