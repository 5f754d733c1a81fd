"""`streamrl sweep`: the same run at every point of a grid of config values, one after the other, and a
table and a plot that compare them: off-policy ratio experiments (η, the off-policy fraction, stale
policy, partial resume against discard, the loss) in one command.

    --grid controller.max_staleness=0,1,4 --grid rollout.partial=resume,discard  ->  6 runs

Every point's config is built and validated before the first run starts, so a typo in the last
value stops the sweep at once, not an hour in. Each run is a plain `streamrl run` into
`OUT/<point>/` (metrics, summary, final weights); a run that fails is reported in its row and the
sweep goes on. `OUT/sweep.json` holds every row, `OUT/sweep.png` the reward curves. With
`logging.tensorboard: true` every point writes its event files to `OUT/tensorboard/<point>/`, so
`tensorboard --logdir OUT/tensorboard` overlays the points' curves.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from .config import Config, ConfigError, load_config
from .procs import EngineStartError
from .rollout import RolloutFailed


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`KEY=V1,V2,...` items as (key, values); commas inside [...] belong to a list value."""
    grid: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, rest = item.partition("=")
        key = key.strip()
        if not sep or not key or not rest.strip():
            raise ConfigError("--grid", f"expected KEY=V1,V2,... (e.g. controller.max_staleness=0,1,4), got '{item}'")
        if key in (k for k, _ in grid):
            raise ConfigError("--grid", f"{key} is given twice; list all its values in one --grid")
        if key == "run_dir":
            raise ConfigError("--grid", "run_dir is set per point by the sweep (use --out for the sweep's folder)")
        values, depth, cur = [], 0, ""
        for ch in rest:
            depth += (ch == "[") - (ch == "]")
            if ch == "," and depth == 0:
                values.append(cur.strip())
                cur = ""
            else:
                cur += ch
        values.append(cur.strip())
        if any(not v for v in values):
            raise ConfigError("--grid", f"'{item}' has an empty value")
        grid.append((key, values))
    if not grid:
        raise ConfigError("--grid", "give at least one --grid KEY=V1,V2,...")
    return grid


def point_name(point: dict[str, str]) -> str:
    """A folder name for a grid point: `max_staleness=4,partial=resume` (last part of each key)."""
    return ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items()).replace("/", "_")


def plan(config: str, grid: list[tuple[str, list[str]]], sets: Sequence[str], out: Path) -> list[tuple[str, dict, Config]]:
    """Every point's name, values and validated config (its run_dir under `out`; with
    `logging.tensorboard`, its event files in `out/tensorboard/<name>`, or `<tensorboard_dir>/<name>`
    when the config sets one: one root, so the curves overlay)."""
    points = []
    for values in itertools.product(*(vals for _, vals in grid)):
        point = {k: v for (k, _), v in zip(grid, values, strict=True)}
        name = point_name(point)
        overrides = [*sets, *(f"{k}={v}" for k, v in point.items()), f"run_dir={out / name}"]
        cfg = load_config(config, overrides)
        lg = cfg.logging
        if lg.tensorboard and "logging.tensorboard_dir" not in point:
            root = Path(lg.tensorboard_dir) if lg.tensorboard_dir is not None else out / "tensorboard"
            cfg = msgspec.structs.replace(cfg, logging=msgspec.structs.replace(lg, tensorboard_dir=str(root / name)))
        points.append((name, point, cfg))
    return points


def _total(rows: list[dict], key: str) -> float:
    return float(sum(r.get(key) or 0 for r in rows))


def describe(summary: dict[str, Any], rows: list[dict]) -> dict[str, Any]:
    """A run's figures for the comparison table, from its summary and metrics rows."""
    tail = rows[-max(1, len(rows) // 10):]  # the final reward: the last tenth of the steps
    wall = summary["train_wall_s"]
    idle = [r["engine_idle_frac"] for r in rows if r.get("engine_idle_frac") is not None]
    return {
        "train_wall_s": wall, "samples": summary["samples"],
        "samples_per_s": summary["samples"] / wall if wall > 0 else float("nan"),
        "final_reward": statistics.fmean(r["reward_mean"] for r in tail),
        "eval_after_sampled": summary["eval_after"]["sampled"], "eval_after_greedy": summary["eval_after"]["greedy"],
        "staleness_max": max((r["staleness_max"] for r in rows), default=0),
        "tokens_generated": _total(rows, "tokens_generated"), "tokens_discarded": _total(rows, "tokens_discarded"),
        "partial_resumed": _total(rows, "partial_resumed"), "dropped_stale": _total(rows, "dropped_stale"),
        "engine_idle_frac": statistics.fmean(idle) if idle else None,
        "trainer_wait_s": _total(rows, "trainer_wait_s"),
    }


async def sweep(config: str, grids: Sequence[str], *, sets: Sequence[str] = (), out: Path | None = None,
                show_progress: bool = True, log: Any = print) -> dict[str, Any]:
    """Run every grid point in turn; returns (and writes to `out/sweep.json`) one row per point with
    its figures and its speedup against the first point (`speedup_vs_first`: that point's wall time
    over this one's)."""
    from .plot import plot_runs, read_metrics
    from .run import run

    grid = parse_grid(grids)
    if out is None:
        base = load_config(config, list(sets))
        out = Path(base.run_dir).parent / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    points = plan(config, grid, sets, out)  # every config checked before the first run
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"config": config, "grid": dict(grid), "sets": list(sets), "out": str(out), "points": []}
    roots = {str(Path(c.logging.tensorboard_dir).parent) for _, _, c in points
             if c.logging.tensorboard and c.logging.tensorboard_dir is not None}
    if len(roots) == 1:  # the points' curves side by side, live
        result["tensorboard"] = roots.pop()
        log(f"sweep: curves with `tensorboard --logdir {result['tensorboard']}`")
    for i, (name, point, cfg) in enumerate(points, 1):
        log(f"sweep {i}/{len(points)}: {name}")
        row: dict[str, Any] = {"name": name, "values": point, "run_dir": cfg.run_dir}
        try:
            summary = await run(cfg, show_progress=show_progress, log=log)
        except (RolloutFailed, EngineStartError) as e:
            row["error"] = str(e)
            log(f"sweep {i}/{len(points)}: {name} failed: {e}")
        else:
            row.update(describe(summary, read_metrics(Path(cfg.run_dir))))
        result["points"].append(row)
        (out / "sweep.json").write_text(json.dumps(result, indent=1))  # partial results survive a stop
    ok = [r for r in result["points"] if "error" not in r]
    if ok and "error" not in result["points"][0]:
        first = result["points"][0]["train_wall_s"]
        for r in ok:
            r["speedup_vs_first"] = first / r["train_wall_s"] if r["train_wall_s"] > 0 else math.nan
    if ok:
        result["plot"] = str(plot_runs({r["name"]: Path(r["run_dir"]) for r in ok}, out / "sweep.png",
                                       title=f"streamrl sweep: {', '.join(k for k, _ in grid)}"))
    (out / "sweep.json").write_text(json.dumps(result, indent=1))
    return result
