"""`streamrl plot`: curves of one or more runs' `metrics.jsonl`, side by side, as a PNG.

`streamrl run` writes `RUN_DIR/metrics.png` with it at the end of a run and `streamrl sweep` one
plot of every grid point. matplotlib draws (Agg, no screen needed); this module only reads
metrics files and lays the panels out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DEFAULT_METRICS = ("reward_mean", "staleness_mean", "engine_idle_frac", "trainer_wait_s")
X_AXES = {"wall_s": "wall time of training (s)", "step": "step", "samples": "samples trained"}


class PlotError(ValueError):
    """A run folder without metrics, or a metric no run has; one line for the user."""


def read_metrics(run_dir: Path) -> list[dict]:
    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        raise PlotError(f"'{run_dir}' has no metrics.jsonl (is it a run folder?)")
    rows = []
    for line in f.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                break  # a run killed mid-write leaves at most one torn last line
    if not rows:
        raise PlotError(f"'{f}' holds no steps yet")
    return rows


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over `window` points: per-step rewards of a small batch are noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(runs: Mapping[str, Path], out: Path, *, x: str = "wall_s",
              metrics: Sequence[str] = DEFAULT_METRICS, title: str | None = None) -> Path:
    """One panel per metric, one line per run (`runs`: label -> run folder); metrics no run logged
    are left out, and so are steps where a metric is null. Returns `out`."""
    if x not in X_AXES:
        raise PlotError(f"x axis must be one of {', '.join(X_AXES)}, got '{x}'")
    data = {label: read_metrics(d) for label, d in runs.items()}
    shown = [m for m in metrics if any(r.get(m) is not None for rows in data.values() for r in rows)]
    if not shown:
        raise PlotError(f"no run logged any of {', '.join(metrics)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 2.6 * len(shown)), sharex=True, squeeze=False)
    for ax, metric in zip(axes[:, 0], shown, strict=True):
        for label, rows in data.items():
            pts = [(r[x], r[metric]) for r in rows if r.get(metric) is not None and x in r]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, smooth(ys, max(1, len(ys) // 25)), label=label, linewidth=1.4)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel(X_AXES[x])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_run(run_dir: Path, log: Any = print) -> str | None:
    """`RUN_DIR/metrics.png` at the end of a run; a plot that cannot be drawn is a warning, never a
    failed run (its results are already written)."""
    try:
        return str(plot_runs({run_dir.name: run_dir}, run_dir / "metrics.png", title=f"streamrl run: {run_dir}"))
    except Exception as e:  # noqa: BLE001
        log(f"warning: no metrics.png ({type(e).__name__}: {e})")
        return None
