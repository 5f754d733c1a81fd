"""Reproducible async runs (`controller.deterministic`) and dynamic sampling (`rollout.dynamic_sampling`),
through the console script on the quickstart config with a fresh tiny model."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, STREAMRL
from safetensors.torch import load_file

from streamrl.buffer import StalenessController
from streamrl.config import ControllerConfig
from streamrl.metrics import WALL_CLOCK_FIELDS
from streamrl.types import Group, Sample

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
TESTS = Path(__file__).parent
REWARDS = TESTS / "rewards_for_tests.py"


def run(tmp_path: Path, name: str, *sets: str, check: bool = True) -> subprocess.CompletedProcess:
    """The quickstart on a tiny model built at tmp_path/model (no warm start)."""
    cmd = [*STREAMRL, "run", QUICKSTART, "--no-progress", "--set", f"run_dir={tmp_path / name}",
           "--set", f"model.path={tmp_path / 'model'}", "--set", "warm_start.enabled=false",
           "--set", "save_samples=true", "--set", "data.eval_size=16"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=TESTS, timeout=600)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def rows(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]


def logical(d: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_FIELDS} for r in rows(d)]


def weights(d: Path) -> dict:
    return {k: v for f in sorted((d / "final").glob("*.safetensors")) for k, v in load_file(f).items()}


def groups(d: Path) -> list[dict]:
    return [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]


DET = ["controller.deterministic=true", "controller.max_staleness=2", "schedule.steps=30",
       f"data.reward={REWARDS}:length_reward"]


@pytest.mark.slow
def test_two_deterministic_async_runs_are_the_same_run(tmp_path: Path) -> None:
    run(tmp_path, "a", *DET)
    run(tmp_path, "b", *DET)
    a, b = tmp_path / "a", tmp_path / "b"
    assert len(rows(a)) == 30
    assert logical(a) == logical(b)
    assert (a / "samples.jsonl").read_bytes() == (b / "samples.jsonl").read_bytes()
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
    # The weights moved (the runs trained), and updates landed on samples in flight: resumed samples
    # hold tokens of two versions, and none of their tokens was thrown away.
    assert any(not bool((wa[k] == load_file(next((tmp_path / "model").glob("*.safetensors")))[k]).all())
               for k in wa if k in load_file(next((tmp_path / "model").glob("*.safetensors"))))
    assert sum(r["partial_resumed"] for r in rows(a)) > 0
    assert any(len(set(s["versions"])) > 1 for g in groups(a) for s in g["samples"])
    assert sum(r["tokens_discarded"] for r in rows(a)) == 0
    assert max(r["staleness_max"] for r in rows(a)) <= 2
    assert max(r["staleness_max"] for r in rows(a)) >= 1  # async: batches hold off-policy tokens


@pytest.mark.slow
def test_a_deterministic_run_with_another_seed_is_another_run(tmp_path: Path) -> None:
    """The check above could pass if nothing varied at all."""
    run(tmp_path, "a", *DET, "schedule.steps=6")
    run(tmp_path, "b", *DET, "schedule.steps=6", "seed=1")
    assert logical(tmp_path / "a") != logical(tmp_path / "b")


@pytest.mark.parametrize(("sets", "needs"), [
    (["engines.pool=ray_serve"], "engines.pool: local"),
    (["engines.num_replicas=2"], "engines.num_replicas: 1"),
    (["schedule.eval_every=5"], "schedule.eval_every: 0"),
    (["rollout.workflow=multi_turn_tools"], "single_turn"),
    (["rollout.partial=retract"], "resume or discard"),
])
def test_what_determinism_cannot_cover_is_one_line(tmp_path: Path, sets: list[str], needs: str) -> None:
    cmd = [*STREAMRL, "config", QUICKSTART, "--set", "controller.deterministic=true"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=TESTS)
    assert p.returncode == 2
    line, = p.stderr.strip().splitlines()
    assert line.startswith("config error: controller.deterministic:") and needs in line, line


def _group(oldest: int, admitted: int = 0) -> Group:
    s = Sample(group_id="g", index=0, prompt_ids=[1])
    s.append([5, 6], [-1.0, -1.0], oldest)
    return Group(group_id="g", samples=[s], admitted_version=admitted)


def test_assign_judges_a_group_against_its_batchs_version() -> None:
    c = StalenessController(ControllerConfig(max_staleness=1, max_offpolicy_fraction=0.5), batch_groups=2)
    for _ in range(4):
        c._pending[0] += 1
    assert c.assign(_group(0), version=0)  # on-policy
    assert c.assign(_group(0), version=1)  # one behind: within η, the batch's one off-policy place
    assert not c.assign(_group(0), version=1)  # off-policy cap of that batch reached: dropped
    assert not c.assign(_group(0), version=2)  # two behind > η: dropped
    assert c.stats.dropped_stale == 2 and c.stats.deferred_offpolicy == 1 and c.returned == 2


@pytest.mark.slow
def test_dynamic_sampling_trains_only_groups_with_signal(tmp_path: Path) -> None:
    run(tmp_path, "ds", "rollout.dynamic_sampling=true", "controller.max_staleness=2", "schedule.steps=12",
        f"data.reward={REWARDS}:half_signal_reward")
    d = tmp_path / "ds"
    trained = groups(d)
    assert len(trained) == 12 * 8  # every batch full
    assert all(len({s["reward"] for s in g["samples"]}) > 1 for g in trained)
    r = rows(d)
    assert sum(x["groups_filtered"] for x in r) > 0
    assert sum(x["prompts_drawn"] for x in r) >= len(trained) + sum(x["groups_filtered"] for x in r) - 3 * 8
    assert max(x["staleness_max"] for x in r) <= 2
    assert sum(x["tokens_discarded"] for x in r) == 0 and sum(x["partial_resumed"] for x in r) > 0


@pytest.mark.slow
def test_dynamic_sampling_and_determinism_together(tmp_path: Path) -> None:
    sets = [*DET, "schedule.steps=8", "rollout.dynamic_sampling=true", f"data.reward={REWARDS}:half_signal_reward"]
    run(tmp_path, "a", *sets)
    run(tmp_path, "b", *sets)
    assert logical(tmp_path / "a") == logical(tmp_path / "b")
    assert sum(x["groups_filtered"] for x in rows(tmp_path / "a")) > 0


def test_data_without_signal_stops_the_run_with_one_line(tmp_path: Path) -> None:
    p = run(tmp_path, "none", "rollout.dynamic_sampling=true", "rollout.max_draws_per_batch=1",
            f"data.reward={REWARDS}:constant_reward", "schedule.steps=5", check=False)
    assert p.returncode == 1, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("error: dynamic sampling: the last 8 groups all had equal rewards"), line
    assert "rollout.max_draws_per_batch" in line and "Traceback" not in p.stderr
