"""`streamrl sweep` (one run per grid point, a table, sweep.json, a plot) and `streamrl plot`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import STREAMRL
from test_run import small_cfg

from streamrl.config import ConfigError
from streamrl.plot import PlotError, read_metrics, smooth
from streamrl.sweep import parse_grid, point_name

PNG = b"\x89PNG\r\n\x1a\n"


def test_grid_parsing_and_point_names() -> None:
    grid = parse_grid(["controller.max_staleness=0,1, 4", "engines.urls=[http://a,http://b],[http://c]"])
    assert grid == [("controller.max_staleness", ["0", "1", "4"]),
                    ("engines.urls", ["[http://a,http://b]", "[http://c]"])]
    assert point_name({"controller.max_staleness": "4", "rollout.partial": "resume"}) == "max_staleness=4,partial=resume"
    for bad, why in [("controller.max_staleness", "expected KEY=V1,V2"), ("=1,2", "expected KEY=V1,V2"),
                     ("trainer.lr=1e-3,", "empty value"), ("run_dir=a,b", "set per point")]:
        with pytest.raises(ConfigError, match=why):
            parse_grid([bad])
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid(["trainer.lr=1", "trainer.lr=2"])
    with pytest.raises(ConfigError, match="at least one"):
        parse_grid([])


def test_smoothing_and_torn_metrics(tmp_path: Path) -> None:
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "wall_s": 0.5}\n{"step": 2, "wall_s": 1.0}\n{"step": 3, "wa')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # a run killed mid-write
    with pytest.raises(PlotError, match="no metrics.jsonl"):
        read_metrics(tmp_path / "nothing")


def test_sweep_runs_every_point_and_compares_them(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = tmp_path / "base.yaml"
    cfg.write_text(json.dumps(small_cfg(tmp_path, tiny_model_dir, schedule={"steps": 4, "batch_groups": 2},
                                        rollout={"group_size": 4, "max_new_tokens": 20},
                                        engines={"max_running_requests": 4})))
    out = tmp_path / "sweep"
    bad = subprocess.run([*STREAMRL, "sweep", str(cfg), "--out", str(out), "--grid", "controller.max_staleness=0,1",
                          "--grid", "trainer.los=grpo,tis"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [bad.stderr.strip()], bad.stderr
    assert "trainer.los" in bad.stderr and "did you mean trainer.loss" in bad.stderr
    assert not out.exists()  # every point is checked before the first run

    p = subprocess.run([*STREAMRL, "sweep", str(cfg), "--out", str(out), "--no-progress",
                        "--grid", "controller.max_staleness=0,2", "--set", "trainer.loss=decoupled_ppo"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "streamrl sweep" in p.stdout and "max_staleness=2" in p.stdout
    result = json.loads((out / "sweep.json").read_text())
    assert [r["name"] for r in result["points"]] == ["max_staleness=0", "max_staleness=2"]
    sync, eta2 = result["points"]
    for r in result["points"]:
        run_dir = Path(r["run_dir"])
        assert run_dir.parent == out and len(read_metrics(run_dir)) == 4 and r["samples"] == 4 * 2 * 4
        assert json.loads((run_dir / "summary.json").read_text())["samples"] == r["samples"]
        assert (run_dir / "config.yaml").read_text().count("decoupled_ppo") == 1  # --set reached every run
        assert (run_dir / "metrics.png").read_bytes()[:8] == PNG  # every run plots itself
        assert 0 <= r["final_reward"] <= 1 and r["tokens_discarded"] == 0
    assert sync["staleness_max"] == 0 and sync["partial_resumed"] == 0 and sync["speedup_vs_first"] == 1.0
    assert eta2["staleness_max"] <= 2
    assert eta2["speedup_vs_first"] == pytest.approx(sync["train_wall_s"] / eta2["train_wall_s"])
    assert (out / "sweep.png").read_bytes()[:8] == PNG

    both = tmp_path / "both.png"
    p = subprocess.run([*STREAMRL, "plot", sync["run_dir"], eta2["run_dir"], "--x", "step", "--metrics",
                        "reward_mean,loss", "--out", str(both)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and both.read_bytes()[:8] == PNG, p.stderr
    p = subprocess.run([*STREAMRL, "plot", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == f"error: '{tmp_path / 'nowhere'}' has no metrics.jsonl (is it a run folder?)"
