"""Continuing a run from a checkpoint (`schedule.resume_from`, `streamrl run --resume`)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
from helpers import STREAMRL
from test_run import read_groups, read_metrics, small_cfg

from streamrl.checkpoint import load_resume
from streamrl.config import ConfigError, config_from_dict
from streamrl.run import run
from streamrl.types import Group

QUIET = {"show_progress": False, "log": lambda *_: None}


def generating(ckpt: Path) -> list[Group]:
    return msgspec.msgpack.decode((ckpt / "generating.msgpack").read_bytes(), type=list[Group])


async def test_resume_continues_the_run_and_its_interrupted_samples(tmp_path: Path, tiny_model_dir: Path) -> None:
    """η = 2 with long responses and few engine rows, a checkpoint every step. Resumed from the first
    checkpoint whose generating groups hold interrupted samples, into the same run folder: steps and
    versions go on from there, each step appears once in metrics.jsonl, and every interrupted sample
    of the checkpoint is trained with its tokens, behaviour logprobs and versions as they were."""
    sections = dict(controller={"max_staleness": 2}, rollout={"group_size": 4, "max_new_tokens": 40},
                    schedule={"steps": 6, "batch_groups": 2, "save_every": 1}, engines={"max_running_requests": 2})
    first = await run(config_from_dict(small_cfg(tmp_path, tiny_model_dir, **sections)), **QUIET)
    run_dir = Path(first["run_dir"])
    ckpt = next(run_dir / "checkpoints" / f"step-{k}" for k in range(1, 6)
                if any(s.status == "partial" and s.num_tokens
                       for g in generating(run_dir / "checkpoints" / f"step-{k}") for s in g.samples))
    state = json.loads((ckpt / "state.json").read_text())
    k = state["step"]
    interrupted = {(g.group_id, s.index): s for g in generating(ckpt) for s in g.samples
                   if s.status == "partial" and s.num_tokens}

    cfg = small_cfg(tmp_path, tiny_model_dir, **sections)
    cfg["schedule"]["resume_from"] = str(ckpt)
    second = await run(config_from_dict(cfg), **QUIET)

    info = second["resumed_from"]
    assert info["step"] == k and info["partial_samples"] >= len(interrupted)
    assert info["generating_groups"] == state["generating_groups"] and info["queued_groups"] == state["queued_groups"]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["version"] for r in rows] == list(range(1, 7))
    assert rows[-1]["samples"] == 6 * 2 * 4
    resumed_rows = rows[k:]
    assert sum(r["tokens_discarded"] for r in resumed_rows) == 0
    assert max(r["staleness_max"] for r in resumed_rows) <= 2
    groups = read_groups(run_dir)
    assert len(groups) == 6 * 2
    trained = {(g.group_id, s.index): s for g in groups[k * 2:] for s in g.samples}
    for key, before in interrupted.items():
        after = trained[key]  # every interrupted sample was trained after the resume
        n = before.num_tokens
        assert after.response_ids[:n] == before.response_ids and after.logprobs[:n] == before.logprobs
        assert after.versions[:n] == before.versions and all(v >= k for v in after.versions[n:])
        assert after.num_resumes >= before.num_resumes
    assert second["groups_admitted"] == 6 * 2  # the run's budget, counted over both processes


def test_resume_errors_name_the_key(tmp_path: Path, tiny_model_dir: Path) -> None:
    def cfg(resume: str, **schedule: object) -> object:
        c = small_cfg(tmp_path, tiny_model_dir)
        c["schedule"] = {**c["schedule"], "resume_from": resume, **schedule}
        return config_from_dict(c)

    with pytest.raises(ConfigError, match=r"schedule\.resume_from: '.*nowhere' is not a checkpoint folder"):
        load_resume(cfg(str(tmp_path / "nowhere")))
    old = tmp_path / "old"
    old.mkdir()
    (old / "state.json").write_text(json.dumps({"step": 2, "version": 2, "queued_groups": 0, "partials": 0}))
    with pytest.raises(ConfigError, match="older streamrl"):
        load_resume(cfg(str(old)))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = {"format": 2, "step": 4, "version": 4, "samples": 32, "queued_groups": 0, "partials": 0,
             "generating_groups": 0, "prompts_drawn": 8, "next_seed": 40, "batch_groups": 2, "group_size": 4,
             "base_model": str(tiny_model_dir)}
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match="incomplete: no optimizer.pt"):
        load_resume(cfg(str(ckpt)))
    for f in ("optimizer.pt", "rollout_state.msgpack", "generating.msgpack", "config.json"):
        (ckpt / f).write_bytes(b"")
    with pytest.raises(ConfigError, match=r"schedule\.steps: the checkpoint is at step 4"):
        load_resume(cfg(str(ckpt), steps=4))
    with pytest.raises(ConfigError, match=r"schedule\.batch_groups: the checkpoint's run used 2"):
        load_resume(cfg(str(ckpt), batch_groups=3))
    assert load_resume(cfg(str(ckpt))).state.step == 4  # steps 6 > 4, same shape: resumable


def test_a_killed_run_resumes_from_its_last_checkpoint_via_cli(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`streamrl run` stopped by SIGTERM after a checkpoint, then `streamrl run --resume`: the second
    process trains the remaining steps and metrics.jsonl reads as one run. A checkpoint that does not
    exist is one line, exit 2."""
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(json.dumps(small_cfg(  # JSON is YAML
        tmp_path, tiny_model_dir, controller={"max_staleness": 1},
        schedule={"steps": 60, "batch_groups": 2, "save_every": 2})))
    run_dir = tmp_path / "run"
    p = subprocess.Popen([*STREAMRL, "run", str(cfg_file), "--no-progress"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "step-4" / "state.json").is_file():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-2000:]
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    done = max(r["step"] for r in read_metrics(run_dir))
    ckpt = max((run_dir / "checkpoints").glob("step-*/state.json"), key=lambda f: int(f.parent.name[5:])).parent
    k = int(ckpt.name[5:])
    assert k <= done < 60

    bad = subprocess.run([*STREAMRL, "run", str(cfg_file), "--no-progress", "--resume", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("config error: schedule.resume_from:"), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1

    p = subprocess.run([*STREAMRL, "run", str(cfg_file), "--no-progress", "--resume", str(ckpt)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming from {ckpt} (step {k})" in p.stdout
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 61)) and rows[-1]["version"] == 60
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"]["step"] == k and summary["samples"] == 60 * 2 * 4
