"""What reproducibility costs: the quickstart deterministic (`controller.deterministic`), free-running
async and synchronous, side by side in one process run, interleaved round by round.

    python bench/deterministic.py [--steps 1000] [--eta 2] [--rounds 1]

Modes, all from configs/quickstart.yaml through `streamrl run` (the console script's code path, one
subprocess per run): `sync` (max_staleness 0), `async` (max_staleness = --eta, free running), `det`
and `det-again` (the same, deterministic, twice: the second checks the first is reproduced).
Reported per mode: RL wall time (`train_wall_s`), samples/s, slowdown of `det` against `async`,
speedup against `sync`, final reward, held-out sampled accuracy after, partial resumes, and whether
the two deterministic runs match (metrics without wall-clock fields, samples.jsonl bytes, final
weights bitwise). Writes bench/results/deterministic.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _table import print_table, write_results

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def mode_sets(eta: int) -> dict[str, list[str]]:
    return {"sync": ["controller.max_staleness=0"], "async": [f"controller.max_staleness={eta}"],
            "det": [f"controller.max_staleness={eta}", "controller.deterministic=true"],
            "det-again": [f"controller.max_staleness={eta}", "controller.deterministic=true"]}


def one_run(run_dir: Path, steps: int, sets: list[str]) -> dict:
    cmd = [str(Path(sys.executable).with_name("streamrl")), "run", str(REPO / "configs" / "quickstart.yaml"),
           "--no-progress", "--set", f"run_dir={run_dir}", "--set", f"schedule.steps={steps}",
           "--set", "save_samples=true", "--set", f"warm_start.cache_dir={REPO / '.cache' / 'streamrl'}",
           "--set", f"model.path={REPO / '.cache' / 'streamrl' / 'tiny-model'}"]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {p.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tail = rows[-max(1, len(rows) // 10):]
    return {"train_wall_s": round(summary["train_wall_s"], 2), "samples": rows[-1]["samples"],
            "samples_per_s": round(rows[-1]["samples"] / summary["train_wall_s"], 1),
            "final_reward": round(sum(r["reward_mean"] for r in tail) / len(tail), 4),
            "sampled_after": summary["eval_after"]["sampled"],
            "partial_resumed": sum(r["partial_resumed"] for r in rows),
            "dropped_stale": sum(r["dropped_stale"] for r in rows),
            "staleness_max": max(r["staleness_max"] for r in rows)}


def same_run(a: Path, b: Path) -> dict[str, bool]:
    """The reproducibility checks of tests/test_deterministic.py, on these two runs."""
    from safetensors.torch import load_file

    from streamrl.metrics import WALL_CLOCK_FIELDS

    def rows(d: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if k not in WALL_CLOCK_FIELDS}
                for x in (d / "metrics.jsonl").read_text().splitlines()]

    def weights(d: Path) -> dict:
        return {k: v for f in sorted((d / "final").glob("*.safetensors")) for k, v in load_file(f).items()}

    wa, wb = weights(a), weights(b)
    return {"metrics": rows(a) == rows(b),
            "samples": (a / "samples.jsonl").read_bytes() == (b / "samples.jsonl").read_bytes(),
            "weights": wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="trainer steps per run (the quickstart's 1000)")
    ap.add_argument("--eta", type=int, default=2, help="controller.max_staleness of the async modes")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "deterministic.json"))
    args = ap.parse_args(argv)
    modes = mode_sets(args.eta)
    per: dict[str, list[dict]] = {m: [] for m in modes}
    checks = []
    with tempfile.TemporaryDirectory(prefix="streamrl-det-") as tmp:
        for k in range(args.rounds):
            for m, sets in modes.items():
                per[m].append(one_run(Path(tmp) / f"{m}-{k}", args.steps, sets))
                print(f"round {k} {m}: {per[m][-1]}", flush=True)
            checks.append(same_run(Path(tmp) / f"det-{k}", Path(tmp) / f"det-again-{k}"))
    med = {m: statistics.median(r["train_wall_s"] for r in rs) for m, rs in per.items()}
    rows = []
    for m, rs in per.items():
        last = rs[-1]
        rows.append({"mode": m, "settings": modes[m], "train_wall_s": med[m], **{k: v for k, v in last.items() if k != "train_wall_s"},
                     "slowdown_vs_async": round(med[m] / med["async"], 3),
                     "speedup_vs_sync": round(med["sync"] / med[m], 3)})
    reproduced = {k: all(c[k] for c in checks) for k in ("metrics", "samples", "weights")}
    print_table(f"quickstart, {args.steps} steps, η = {args.eta} (median of {args.rounds} round(s))",
                ["mode", "RL wall s", "samples/s", "vs async", "vs sync", "final reward", "sampled after", "resumed"],
                [[r["mode"], r["train_wall_s"], r["samples_per_s"], f"{r['slowdown_vs_async']:.2f}×",
                  f"{r['speedup_vs_sync']:.2f}×", r["final_reward"], r["sampled_after"], r["partial_resumed"]] for r in rows])
    print(f"deterministic runs reproduced: {reproduced}")
    write_results(args.out, {"steps": args.steps, "eta": args.eta, "rounds": args.rounds}, rows, reproduced=reproduced)
    return 0 if all(reproduced.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
