"""The `streamrl` command: run | rollout | sweep | plot | serve | init-model | config | generate.

Configuration errors print one line (`config error: <key>: <problem>`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path


def _run_config_command(args: argparse.Namespace, make_coro, report) -> int:  # noqa: ANN001
    """Load the config, run `make_coro(cfg, show_progress)` and `report` its result. A config error
    is one line and exit 2; an engine that cannot start or groups that keep failing, exit 1."""
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.set or [])
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    from .errors import StreamrlError
    from .procs import EngineStartError
    from .rollout.ray_serve_pool import RayStartError
    from .trainer import TrainerFailed

    try:
        result = _run_async(make_coro(cfg, not args.no_progress and sys.stderr.isatty()))
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    except (RayStartError, EngineStartError, StreamrlError, TrainerFailed) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    report(result)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .run import run

    if args.resume:
        args.set = [*(args.set or []), f"schedule.resume_from={args.resume}"]

    return _run_config_command(args, lambda cfg, progress: run(cfg, show_progress=progress), _print_summary)


def _cmd_rollout(args: argparse.Namespace) -> int:
    from .rollout_only import rollout_only

    def make(cfg, progress):  # noqa: ANN001, ANN202
        groups = args.groups if args.groups is not None else cfg.schedule.batch_groups
        return rollout_only(cfg, groups=groups, out=Path(args.out) if args.out else None, show_progress=progress)

    return _run_config_command(args, make, _print_rollout_summary)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .sweep import parse_grid, sweep

    try:
        parse_grid(args.grid or [])  # a bad --grid is one line before the config is even read
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    failed: list[str] = []

    def report(result: dict) -> None:
        _print_sweep(result)
        failed.extend(r["name"] for r in result["points"] if "error" in r)

    def make(cfg, progress):  # noqa: ANN001, ANN202 - cfg: the base config, checked before any run
        return sweep(args.config, args.grid, sets=args.set or [], out=out, show_progress=progress)

    rc = _run_config_command(args, make, report)
    return rc if rc or not failed else 1


def _print_sweep(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"streamrl sweep: {result['out']}")
    for col in ("point", "RL wall s", "samples/s", "speedup vs first", "final reward", "held-out (sampled)",
                "staleness max", "tokens discarded", "resumed", "engine idle"):
        t.add_column(col, justify="left" if col == "point" else "right", no_wrap=col == "point")
    for r in result["points"]:
        if "error" in r:
            t.add_row(r["name"], f"failed: {r['error']}", *[""] * 8)
            continue
        idle = r["engine_idle_frac"]
        t.add_row(r["name"], f"{r['train_wall_s']:.1f}", f"{r['samples_per_s']:.0f}",
                  f"{r.get('speedup_vs_first', float('nan')):.2f}", f"{r['final_reward']:.3f}",
                  f"{r['eval_after_sampled']:.3f}", f"{r['staleness_max']:.0f}", f"{r['tokens_discarded']:.0f}",
                  f"{r['partial_resumed']:.0f}", "-" if idle is None else f"{idle:.2f}")
    # Piped or redirected (a log file), rich would fold ten columns into 80; a sweep's table is read whole.
    Console(width=None if sys.stdout.isatty() else 170).print(t)
    print(f"rows: {result['out']}/sweep.json" + (f"; plot: {result['plot']}" if result.get("plot") else ""))


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import DEFAULT_METRICS, PlotError, plot_runs

    runs = {}
    for d in args.run_dirs:
        name = Path(d).name or d
        runs[name if name not in runs else d] = Path(d)
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "metrics.png"
    metrics = [m.strip() for m in (args.metrics or "").split(",") if m.strip()] or DEFAULT_METRICS
    try:
        path = plot_runs(runs, out, x=args.x, metrics=metrics)
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"plot: {path}")
    return 0


def _print_rollout_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"streamrl rollout: {s['groups']} groups, {s['samples']} samples in {s['wall_s']:.1f} s")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("reward (mean)", f"{s['reward_mean']:.3f}")
    t.add_row("groups with a learning signal", f"{s['groups_with_signal']} / {s['groups']}")
    t.add_row("response tokens: mean / p50 / p90 / max",
              f"{s['length_mean']:.1f} / {s['length_p50']} / {s['length_p90']} / {s['length_max']}")
    t.add_row("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(s["finish_reasons"].items())))
    t.add_row("samples/s, tokens/s", f"{s['samples_per_s']:.1f}, {s['tokens_per_s']:.0f}")
    if "turns_mean" in s:
        t.add_row("model turns per sample (mean)", f"{s['turns_mean']:.2f}")
        t.add_row("tool calls: per sample / errors", f"{s['tool_calls_per_sample']:.2f} / {s['tool_errors']}")
        t.add_row("tokens masked out of the loss", f"{s['masked_token_frac']:.1%}")
    if s["failed_groups"]:
        t.add_row("failed groups (retried)", str(s["failed_groups"]))
        t.add_row("the last failure", str(s.get("last_error")))
    Console().print(t)
    if s.get("judged_examples"):
        j = Table(title="the judge's verdicts (first samples)")
        for col in ("prompt", "response", "judge's text", "score"):
            j.add_column(col, justify="right" if col == "score" else "left")
        for e in s["judged_examples"]:
            v = e["judge"]
            j.add_row(e["prompt"], repr(e["response"]), repr(v.get("text", v.get("error"))),
                      "failed" if "error" in v else f"{v['score']:g}")
        Console().print(j)
    if s.get("judge"):
        print(_judge_line(s["judge"]))
    print(f"samples: {s['out']}")


def _judge_line(j: dict) -> str:
    return (f"judge: {j['calls']} calls, {j['failures']} failed, {j['retries']} retried; {j['calls_per_s']:.1f} "
            f"judgments/s, {j['tokens_per_s']:.0f} tokens/s, {j['latency_mean_s'] * 1000:.0f} ms per judgment")


def _run_async(coro):  # noqa: ANN001, ANN202
    """Run `coro`; SIGINT and SIGTERM stop it at any point, and its cleanup (engine servers, routers) runs."""
    from .procs import run_stoppable

    return run_stoppable(coro)


def _print_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"streamrl run: {s['run_dir']}")
    t.add_column("")
    t.add_column("before RL")
    t.add_column("after RL")
    for k in ("greedy", "sampled"):
        t.add_row(f"held-out accuracy ({k})", f"{s['eval_before'][k]:.3f}", f"{s['eval_after'][k]:.3f}")
    for k in (k for k in s["eval_after"] if "/" in k):  # per task (data.tasks): sampled/<task>, greedy/<task>
        t.add_row(f"  {k.split('/', 1)[1]} ({k.split('/', 1)[0]})", f"{s['eval_before'].get(k, float('nan')):.3f}",
                  f"{s['eval_after'][k]:.3f}")
    for k in ("greedy", "sampled"):  # data.eval_reward against the training reward (a judge against exact match)
        if f"agreement_{k}" in s["eval_after"]:
            t.add_row(f"training reward agrees with eval_reward ({k})",
                      *(f"{v:.3f}" if (v := s[e].get(f"agreement_{k}")) is not None else "-" for e in ("eval_before", "eval_after")))
    Console().print(t)
    if s.get("judge"):
        print(_judge_line(s["judge"]))
    print(
        f"{s['steps']} steps, {s['samples']} samples in {s['train_wall_s']:.1f} s of training "
        f"({s['total_wall_s']:.1f} s total); metrics: {s['run_dir']}/metrics.jsonl; weights: {s['final_model']}"
        + (f"; plot: {s['plot']}" if s.get("plot") else "")
    )


def _cmd_init_model(args: argparse.Namespace) -> int:
    from .tasks import build_tiny_model, count_parameters

    path = build_tiny_model(args.dir, preset=args.preset, seed=args.seed, arch=args.arch, agent=args.agent,
                             tools=args.tools)
    from transformers import AutoModelForCausalLM

    n = count_parameters(AutoModelForCausalLM.from_pretrained(path))
    print(f"wrote {args.preset} {args.arch} model ({n / 1e6:.2f} M parameters) to {path}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from .config import ConfigError, describe_config, load_config

    try:
        cfg = load_config(args.config, args.set or [], check_paths=False) if args.config or args.set else None
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(describe_config(cfg))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    """A small generation demo: prompts through the embedded engine, concurrently."""
    from .engine import EngineError, TorchEngine

    if not (Path(args.model) / "config.json").is_file():
        print(f"error: --model: '{args.model}' is not a model folder (try `streamrl init-model DIR`)", file=sys.stderr)
        return 2

    async def main() -> None:
        async with TorchEngine(args.model, device=args.device) as eng:
            tok = eng.tokenizer
            assert tok is not None
            ids = [[tok.bos_token_id, *tok(p, add_special_tokens=False)["input_ids"]] for p in args.prompt]
            params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
            results = await asyncio.gather(*[eng.generate(i, params) for i in ids])
            for p, r in zip(args.prompt, results, strict=True):
                print(f"{p!r} -> {r['text']!r}  ({r['meta_info']['finish_reason']['type']})")

    try:
        _run_async(main())
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="streamrl", description="Asynchronous, streaming RL for LLMs.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="train: rollouts -> buffer -> trainer -> new weights",
                       description="Train from a YAML config. `streamrl config` lists every key.")
    p.add_argument("config", help="YAML config file (e.g. configs/quickstart.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. schedule.steps=50")
    p.add_argument("--resume", metavar="CHECKPOINT",
                   help="continue from a checkpoint folder, RUN_DIR/checkpoints/step-N (= --set schedule.resume_from=...)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.set_defaults(fn=_cmd_run)

    p = sub.add_parser("rollout", help="rollouts and rewards only, no trainer: samples to JSONL",
                       description="Generate and score groups with the config's task, model and engines, "
                                   "without training; write them as JSONL and print a summary.")
    p.add_argument("config", help="YAML config file (e.g. configs/quickstart.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key, e.g. rollout.temperature=0.7")
    p.add_argument("--groups", type=_positive_int, default=None,
                   help="groups to generate (default: schedule.batch_groups, one training batch)")
    p.add_argument("--out", default=None, help="JSONL file for the groups (default: RUN_DIR/rollouts.jsonl)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.set_defaults(fn=_cmd_rollout)

    p = sub.add_parser("sweep", help="off-policy ratio experiments: one run per grid point, a table and a plot",
                       description="Run the config once per point of a grid of values (the product of every "
                                   "--grid), one after the other, and compare the runs.")
    p.add_argument("config", help="YAML config file (e.g. configs/quickstart.yaml)")
    p.add_argument("--grid", action="append", metavar="KEY=V1,V2,...",
                   help="values of one key, e.g. controller.max_staleness=0,1,4 (repeat for a product)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a key in every run")
    p.add_argument("--out", default=None, help="the sweep's folder (default: next to run_dir, sweep-DATE)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.set_defaults(fn=_cmd_sweep)

    p = sub.add_parser("plot", help="curves of runs' metrics.jsonl, side by side, as a PNG")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="PNG file (default: FIRST_RUN_DIR/metrics.png)")
    p.add_argument("--x", default="wall_s", choices=["wall_s", "step", "samples"])
    p.add_argument("--metrics", default=None,
                   help="comma-separated metrics.jsonl fields (default: reward_mean,staleness_mean,"
                        "engine_idle_frac,trainer_wait_s)")
    p.set_defaults(fn=_cmd_plot)

    # `streamrl serve ...` goes to the server's own parser whole (see `main`); listed here for --help.
    sub.add_parser("serve", help="an SGLang-compatible HTTP server for a model (`streamrl serve --help`, docs/http.md)")

    p = sub.add_parser("init-model", help="write a tiny random HF model folder (offline)")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", help="tiny (~1 M) | small (~4 M) | bench100m (~85 M)")
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agent", action="store_true", help="with chat and tool-call tokens and a chat template")
    p.add_argument("--tools", action="store_true", help="an agent model whose chat template renders tools and "
                   "tool calls in the Hermes / Qwen form (<tool_call>{json}</tool_call>)")
    p.set_defaults(fn=_cmd_init_model)

    p = sub.add_parser("config", help="list every config key with its type, default and meaning")
    p.add_argument("config", nargs="?", help="show this file's values instead of the defaults")
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.set_defaults(fn=_cmd_config)

    p = sub.add_parser("generate", help="generate with the embedded engine (demo)")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default="auto")
    p.set_defaults(fn=_cmd_generate)
    return ap


def _interrupt(sig: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    # SIGTERM ends any command as Ctrl-C does, also while it still imports: "interrupted", exit 130.
    signal.signal(signal.SIGTERM, _interrupt)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # streamrl's progress only: transformers' and the hub's bars (loading, writing weights) stay off,
    # here and in every process a command starts (the trainer, launched servers inherit it).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # its options (--model, --port, ...) are the server's: parsed there
        from .engine.http.server import main as serve_main

        return int(serve_main(argv[1:], prog="streamrl serve") or 0)
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
