"""What one call of the code tool (`tools.python`) costs: the fork server (a launcher forked per call
from a warm interpreter, as a run makes its calls) against an interpreter started per call (the
launcher run as `python -I -S sandbox_launch.py SETTINGS CODE`, as the probe runs it), the same
sandbox (this machine's strongest) and the same code, side by side in one process run.

Per path: wall time per call one at a time, CPU time per call (every process of the call, the
server's share included), and calls per second with 64 at once (a group's tool calls arriving
together).

    python bench/code_tool.py [--calls 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path

from _table import print_table, write_results

from streamrl.config.schema import PythonToolConfig
from streamrl.rollout.sandbox import LAUNCHER, PythonTool, encode_settings, probe

RESULTS = Path(__file__).parent / "results"
CODE = "print(123 * 45)"
HZ = os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _server_cpu(pid: int) -> float:
    """The fork server's CPU time and that of the calls it has reaped (utime, stime, cutime, cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / HZ


async def fork_server(tool: PythonTool, calls: int) -> dict[str, float]:
    await tool.run(CODE)  # the server started
    assert tool.server.pid is not None
    cpu0, t0 = _server_cpu(tool.server.pid), time.perf_counter()
    for _ in range(calls):
        assert (await tool.run(CODE)) == "5535\n"
    wall = (time.perf_counter() - t0) / calls
    cpu = (_server_cpu(tool.server.pid) - cpu0) / calls
    t0 = time.perf_counter()
    await asyncio.gather(*(tool.run(CODE) for _ in range(64)))
    return {"wall_ms": 1000 * wall, "cpu_ms": 1000 * cpu, "calls_per_s_64": 64 / (time.perf_counter() - t0)}


async def interpreter_per_call(tool: PythonTool, calls: int) -> dict[str, float]:
    argv = [tool.python, "-I", "-S", str(LAUNCHER), encode_settings(tool.settings(None)), CODE]

    async def one() -> None:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                    stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
        out, _ = await proc.communicate()
        assert out == b"5535\n", out

    cpu0, t0 = _children_cpu(), time.perf_counter()
    for _ in range(calls):
        await one()
    wall = (time.perf_counter() - t0) / calls
    cpu = (_children_cpu() - cpu0) / calls
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(64)))
    return {"wall_ms": 1000 * wall, "cpu_ms": 1000 * cpu, "calls_per_s_64": 64 / (time.perf_counter() - t0)}


async def main_async(args: argparse.Namespace) -> list[dict]:
    tool = PythonTool(PythonToolConfig(enabled=True, network="none" if probe().network_namespace else "allowed"))
    per: dict[str, list[dict[str, float]]] = {"fork server": [], "interpreter per call": []}
    try:
        for k in range(args.rounds):  # interleaved: the machine drifts
            per["fork server"].append(await fork_server(tool, args.calls))
            per["interpreter per call"].append(await interpreter_per_call(tool, args.calls))
            print(f"round {k + 1}/{args.rounds}:", {p: {m: round(v, 2) for m, v in r[-1].items()}
                                                     for p, r in per.items()}, flush=True)
    finally:
        await tool.aclose()
    rows = [{"path": path, **{m: round(statistics.median(r[m] for r in rounds), 2) for m in rounds[0]},
             "rounds": rounds} for path, rounds in per.items()]
    base = rows[1]
    for r in rows:
        r["cpu_vs_interpreter"] = round(r["cpu_ms"] / base["cpu_ms"], 2)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=100, help="calls one at a time, per path and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, interleaved; medians reported")
    ap.add_argument("--out", default=str(RESULTS / "code_tool.json"))
    args = ap.parse_args(argv)
    rows = asyncio.run(main_async(args))
    cols = ["path", "wall_ms", "cpu_ms", "cpu_vs_interpreter", "calls_per_s_64"]
    print_table(f"code tool: one call of `{CODE}` ({probe().mode} sandbox)", cols, ([r[c] for c in cols] for r in rows))
    write_results(args.out, {"calls": args.calls, "rounds": args.rounds, "sandbox": probe().mode,
                             "cpus": os.cpu_count()}, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
