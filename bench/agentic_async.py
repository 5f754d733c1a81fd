"""Synchronous vs asynchronous agentic RL when the environment is slow: the agentic quickstart
(`configs/agentic.yaml`: 3-digit x 2-digit products with a calculator tool) with a calculator whose
latency has a long tail (bench/_slow_tool.py: max x u^4, u uniform), at two maxima: 300 ms and 1 s
(a sandboxed code run, a web search or a judge call takes that long). One process run.

Synchronous RL waits, every batch, for the slowest tool call of its 64 samples while the engines and
the trainer idle; asynchronous RL keeps other groups generating while tools wait. Every mode uses the
same warm-started model (the quickstart's, cached), seed, task and sample budget through the same
`streamrl.run.run` code path; only the controller settings differ. Reported per mode: wall time to the
budget, speedup over sync, final reward and held-out accuracy (equal reward is the point), tokens
discarded, tool calls, and tool calls that ran more than once for the same sample and turn (must be
0: a turn interrupted by a weight update resumes after its tool result, never before it).

With `--tool code` the calculator is the code tool itself (`tools.python`'s sandbox, real): each call
is a sandboxed program that waits as long, then prints the model's expression evaluated by Python; the
sandbox's own cost (a process tree and its namespaces per call) is in the loop. Each tool is a part of
bench/results/agentic_async.json (`slow_tool`, `code_tool`): a run replaces its own part only.

    python bench/agentic_async.py [--steps 150] [--modes sync,eta4,eta8-push4] [--latencies 0.3,1.0] [--rounds 2]
    python bench/agentic_async.py --tool code
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import _slow_tool
import yaml
from _table import print_table, write_results
from async_vs_sync import MODES, add_speedups, run_mode, summarize  # the long-tail benchmark's settings

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"

DEFAULT_MODES = ("sync", "eta4", "eta8-push4")


def tool_reruns() -> tuple[int, int]:
    """(tool calls run, calls that ran more than once for the same sample and turn)."""
    return sum(_slow_tool.EXECUTED.values()), sum(n - 1 for n in _slow_tool.EXECUTED.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="trainer steps per mode (the quickstart's 150)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"any of {', '.join(MODES)}")
    ap.add_argument("--latencies", type=lambda v: [float(x) for x in v.split(",")], default=[0.3, 1.0],
                    help="the tool's longest latency in seconds, one comparison each (a call takes max * u^4)")
    ap.add_argument("--tool", default="slow", choices=["slow", "code"],
                    help="slow: the calculator behind an asyncio wait; code: the calculator as a program run by "
                         "the code tool's sandbox (tools.python), which waits as long. Each is a part of the "
                         "results file (`slow_tool`, `code_tool`)")
    ap.add_argument("--pool", default="http", choices=["http", "local"],
                    help="engines in their own process (`streamrl serve`, as in production) or in-process")
    ap.add_argument("--rounds", type=int, default=2,
                    help="run the mode list this many times, interleaved; report medians (machines here drift)")
    ap.add_argument("--work-dir", default=str(REPO / "runs" / "bench-agentic"))
    ap.add_argument("--out", default=str(RESULTS / "agentic_async.json"))
    args = ap.parse_args(argv)
    if unknown := [m for m in args.modes.split(",") if m not in MODES]:
        ap.error(f"--modes: unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    base = yaml.safe_load((REPO / "configs" / "agentic.yaml").read_text())
    cache = REPO / ".cache" / "streamrl"
    base["run_dir"] = f"{args.work_dir}-{args.tool}"
    base["model"]["path"] = str(cache / "tiny-agent-model")
    base["warm_start"]["cache_dir"] = str(cache)
    base["engines"]["pool"] = args.pool
    base["tools"]["functions"] = [f"calculator=_slow_tool:{args.tool}_calculator"]
    base["rollout"]["workflow"] = "_slow_tool:workflow"
    base["schedule"]["steps"] = args.steps
    by_latency: dict[float, list[list[dict]]] = {lat: [] for lat in args.latencies}
    for k in range(args.rounds):
        for lat in args.latencies:
            _slow_tool.MAX_S = lat
            rows = []
            for name in args.modes.split(","):
                _slow_tool.EXECUTED.clear()
                _slow_tool.WAITED.clear()
                row = {"tool_max_ms": round(1000 * lat)} | run_mode(name, MODES[name], base)
                row["tool_calls"], row["tool_reruns"] = tool_reruns()
                row["tool_latency_mean_ms"] = round(1000 * statistics.fmean(_slow_tool.WAITED), 1)
                rows.append(row)
                print(f"round {k + 1}/{args.rounds}:", row, flush=True)
            add_speedups(rows)
            by_latency[lat].append(rows)
    rows = []
    for rounds in by_latency.values():
        part = summarize(rounds)
        for r in part:  # the worst of any round
            r["tool_reruns"] = max(x["tool_reruns"] for rs in rounds for x in rs if x["mode"] == r["mode"])
        rows += part

    cols = ["tool_max_ms", "mode", "wall_s", "samples_per_s", "speedup_vs_sync", "engine_idle_frac", "tokens_discarded",
            "staleness_max", "tool_calls", "tool_reruns", "final_reward", "eval_sampled_after"]
    print_table(f"agentic async vs sync, tool latency up to tool_max_ms (x u^4), {rows[0]['samples']} samples per mode",
                cols, ([r[c] for c in cols] for r in rows))
    meta = {"steps": args.steps, "rounds": args.rounds, "pool": args.pool,
            "tool_latency": "tool_max_ms * u^4, u uniform" + (" inside the sandboxed program" if args.tool == "code" else "")}
    extra = {"rounds": [r for rounds in by_latency.values() for r in rounds]} if args.rounds > 1 else {}
    write_results(args.out, meta, rows, section=f"{args.tool}_tool", **extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
