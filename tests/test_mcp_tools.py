"""MCP tools (`tools.mcp`, rollout/mcp_tools.py) against a real stdio MCP server built with the mcp SDK
(examples/mcp_calculator_server.py): the ToolBox starts it, offers its tools in the OpenAI format and
calls them; bad arguments, error results, timeouts and a killed server are observations, never
exceptions; nothing is left running after `aclose`. Then `streamrl run` through the console script: a
run that calls the server outlives it being killed, a server that does not start is one line, and
SIGTERM stops the run and its servers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import REPO, STREAMRL, processes_mentioning
from mcp_workflows_for_tests import KILL_AT, server_pids

from streamrl.config import ConfigError, ToolsConfig, load_config
from streamrl.config.schema import McpServerConfig
from streamrl.rollout.tools import ToolBox

SERVER = REPO / "examples" / "mcp_calculator_server.py"
WORKFLOWS = Path(__file__).parent / "mcp_workflows_for_tests.py"


def toolbox(*servers: McpServerConfig, **tools: object) -> ToolBox:
    return ToolBox(ToolsConfig(mcp=list(servers), **tools))  # type: ignore[arg-type]


def calc(name: str = "calc", command: list[str] | None = None, **kw: object) -> McpServerConfig:
    return McpServerConfig(name=name, command=command or ["python", str(SERVER)], **kw)  # type: ignore[arg-type]


def ours() -> list[int]:
    return server_pids(os.getpid())


async def test_the_toolbox_starts_the_server_offers_its_tools_and_calls_them(tmp_path: Path) -> None:
    tb = toolbox(calc())
    await tb.start(log_dir=tmp_path)
    try:
        assert set(tb.tools) == {"calculator", "multiply", "add", "divide", "sleep"}  # beside the Python tools
        offered = {t["function"]["name"]: t for t in tb.openai_tools()}
        assert set(offered) == {"multiply", "add", "divide", "sleep"}
        mul = offered["multiply"]
        assert mul["type"] == "function" and mul["function"]["description"] == "The product a * b of two integers."
        schema = mul["function"]["parameters"]
        assert schema["type"] == "object" and schema["required"] == ["a", "b"]
        assert schema["properties"]["a"]["type"] == "integer"
        r = await tb.call("multiply", '{"a": 123, "b": 45}')
        assert (r.observation, r.error) == ("5535", None)
        assert (await tb.call("add", '{"a": -1, "b": 2}')).observation == "1"
        assert (await tb.call("calculator", "2*3")).observation == "6"
        assert len(ours()) == 1
    finally:
        await tb.aclose()
    assert ours() == []
    await tb.aclose()  # again: nothing to do


async def test_bad_arguments_and_tool_errors_are_observations() -> None:
    tb = toolbox(calc())
    await tb.start()
    try:
        for args, cause, expected in [
            ("123*45", "arguments", "arguments must be a JSON object, got '123*45'"),
            ("[1, 2]", "arguments", "arguments must be a JSON object, got list"),
            ('{"a": "x", "b": 1}', "result", "Input should be a valid integer"),  # the server's own check
            ('{"a": 1}', "result", "Field required"),
        ]:
            r = await tb.call("multiply", args)
            assert r.error is not None and expected in r.error and r.cause == cause, (args, r)
            assert r.observation.startswith(f"error: {r.error}")
        r = await tb.call("divide", '{"a": 1, "b": 0}')
        assert (r.observation, r.cause) == ("error: Error executing tool divide: division by zero", "result")
        assert (await tb.call("add", "")).cause == "result"  # no arguments at all: the server says what is missing
        assert (await tb.call("add", '{"a": 1, "b": 2}')).observation == "3"  # the server is still there
    finally:
        await tb.aclose()


async def test_a_call_past_its_timeout_is_an_error_observation() -> None:
    tb = toolbox(calc(timeout_s=0.5), timeout_s=60.0)  # the server's own timeout over tools.timeout_s
    await tb.start()
    try:
        r = await tb.call("sleep", '{"seconds": 30}')
        assert (r.observation, r.cause) == ("error: timed out after 0.5 s", "timeout")
        assert 0.5 <= r.seconds < 5
        assert (await tb.call("sleep", '{"seconds": 0.01}')).observation == "awake"
    finally:
        await tb.aclose()


async def test_a_killed_server_is_started_again_by_the_next_call(tmp_path: Path) -> None:
    tb = toolbox(calc(timeout_s=20.0))
    await tb.start(log_dir=tmp_path)
    try:
        [first] = ours()
        os.kill(first, signal.SIGKILL)
        r = await tb.call("multiply", '{"a": 6, "b": 7}')
        assert (r.observation, r.error) == ("42", None)
        [second] = ours()
        assert second != first
        # killed during a call: the call goes once more, to the server started again
        call = asyncio.create_task(tb.call("sleep", '{"seconds": 1}'))
        await asyncio.sleep(0.3)
        os.kill(second, signal.SIGKILL)
        r = await call
        assert (r.observation, r.error) == ("awake", None)
        assert len(ours()) == 1 and second not in ours()
        assert tb.mcp is not None and tb.mcp.servers[0].restarts == 2
    finally:
        await tb.aclose()
    assert ours() == []


@pytest.mark.parametrize(("command", "timeout", "expected"), [
    (["python", "-c", "import sys; sys.exit('no backend for this server')"], 30.0,
     "did not start: it exited before answering; its stderr ends: no backend for this server"),
    (["python", "-c", "import time; time.sleep(60)"], 0.5,
     "did not start: no answer to initialize and tools/list within 0.5 s (tools.mcp[1].startup_timeout_s)"),
])
async def test_a_server_that_does_not_start_is_one_line_naming_its_command(tmp_path: Path, command: list[str],
                                                                          timeout: float, expected: str) -> None:
    tb = toolbox(calc(), calc("broken", command, startup_timeout_s=timeout))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        await tb.start(log_dir=tmp_path)
    msg = str(info.value)
    assert msg.startswith(f"config error: tools.mcp[1].command: MCP server 'broken' ({' '.join(command)}) {expected}")
    assert "\n" not in msg and str(tmp_path / "mcp-broken.log") in msg
    assert time.perf_counter() - t0 < 15
    assert ours() == [] and not processes_mentioning(b"time.sleep(60)")  # the good server stopped too
    await tb.aclose()


async def test_a_tool_name_taken_twice_is_a_config_error_and_prefix_keeps_them_apart() -> None:
    with pytest.raises(ConfigError) as info:
        await toolbox(calc(), calc("calc2")).start()
    assert str(info.value) == ("config error: tools.mcp[1]: MCP server 'calc2' serves a tool 'multiply', the name of "
                               "a tool of tools.mcp[0]; set tools.mcp[1].prefix: true (calc2_multiply)")
    with pytest.raises(ConfigError, match=r"tools.mcp\[0\]: .* 'add', the name of another tool of the run"):
        await toolbox(calc(), functions=[f"add={WORKFLOWS}:multiply"]).start()
    assert ours() == []
    tb = toolbox(calc(), calc("calc2", prefix=True))
    await tb.start()
    try:
        assert {"multiply", "calc2_multiply", "calc2_sleep"} <= set(tb.tools)
        assert "calc2_add" in {t["function"]["name"] for t in tb.openai_tools()}
        assert (await tb.call("calc2_multiply", '{"a": 2, "b": 3}')).observation == "6"
    finally:
        await tb.aclose()
    assert ours() == []


@pytest.mark.parametrize(("sets", "expected"), [
    (["tools.mcp=[{name: calc, command: [no-such-mcp-server-xyz]}]"],
     "tools.mcp[0].command: 'no-such-mcp-server-xyz' is not an executable file on PATH"),
    (["tools.mcp=[{name: calc, command: [python, a.py]}, {name: calc, command: [python, b.py]}]"],
     "tools.mcp[1].name: 'calc' is also the name of tools.mcp[0]"),
    (["tools.mcp=[{name: calc, command: []}]"], "tools.mcp[0].command: expected array of length >= 1, got []"),
    (["tools.mcp=[{name: 'a b', command: [python]}]"], "tools.mcp[0].name: expected str matching regex"),
    (["tools.mcp=[{command: [python]}]"], "tools.mcp[0]: object missing required field name"),
    (["tools.mcp=[{name: calc, command: [python], cwd: /no/such/dir}]"],
     "tools.mcp[0].cwd: folder '/no/such/dir' does not exist"),
    (["tools.mcp=[{name: calc, command: [python], timeout_s: 0}]"], "tools.mcp[0].timeout_s: expected float > 0.0"),
    (["rollout.workflow=single_turn", "tools.mcp=[{name: calc, command: [python]}]"],
     "tools.mcp: rollout.workflow: single_turn calls no tools"),
])
def test_mcp_config_errors_name_the_key(sets: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.workflow=multi_turn_tools", *sets])
    assert str(info.value).startswith(f"config error: {expected}")


def test_the_documented_config_loads() -> None:
    cfg = load_config(str(REPO / "configs" / "agentic_mcp.yaml"), check_paths=False)
    [server] = cfg.tools.mcp
    assert server.command == ["python", "examples/mcp_calculator_server.py"] and cfg.tools.functions == []
    assert (REPO / server.command[1]).is_file()


# ---- streamrl run, through the console script ---------------------------------------------------------------


def _run(tmp_path: Path, workflow: str, *sets: str, server: str | None = None) -> list[str]:
    """The documented MCP config on a fresh tiny model (no warm start), a few short steps; the server
    script copied to tmp_path, so its processes are this test's alone."""
    script = tmp_path / "mcp_calculator_server.py"
    shutil.copy(SERVER, script)
    command = server or f"[python, {script}]"
    cmd = [*STREAMRL, "run", str(REPO / "configs" / "agentic_mcp.yaml"), "--no-progress"]
    for item in [f"run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", "warm_start.enabled=false",
                 f"rollout.workflow={WORKFLOWS}:{workflow}", f"tools.mcp=[{{name: calc, command: {command}}}]",
                 "rollout.max_new_tokens=16", "rollout.group_size=4", "schedule.batch_groups=2", "data.eval_size=8",
                 *sets]:
        cmd += ["--set", item]
    return cmd


def test_a_run_calls_the_mcp_server_and_outlives_it_being_killed(tmp_path: Path) -> None:
    """The 24th call finds its server killed (SIGKILL, mid-training): the server is started again, that
    call and the ones in flight go to it, and the run ends as any other, every call answered."""
    p = subprocess.run(_run(tmp_path, "multiply_killing_the_server", "schedule.steps=4", "save_samples=true"),
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "mcp: server 'calc' (tools.mcp[0]) went away; starting it again" in p.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and sum(r["tool_calls"] for r in rows) == 4 * 2 * 4 > KILL_AT - 16
    assert sum(r["tool_errors"] for r in rows) == 0
    turns = [t for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
             for s in json.loads(line)["samples"] for t in s["turns"] if t["kind"] == "tool"]
    assert len(turns) == 32 and all(t["tool"] == "multiply" and t.get("error") is None for t in turns)
    assert not processes_mentioning(str(tmp_path / "mcp_calculator_server.py").encode())


def test_a_run_whose_server_does_not_start_stops_with_one_line(tmp_path: Path) -> None:
    p = subprocess.run(_run(tmp_path, "multiply", server="[python, -c, 'import sys; sys.exit(\"no backend\")']"),
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("config error: tools.mcp[0].command: MCP server 'calc' (python -c import sys; "
                           "sys.exit(\"no backend\")) did not start: it exited before answering; its stderr ends: "
                           "no backend"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sigterm_stops_a_run_and_its_mcp_servers_within_seconds(tmp_path: Path) -> None:
    p = subprocess.Popen(_run(tmp_path, "multiply", "schedule.steps=1000"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + 240
    while not metrics.is_file() or not metrics.read_text():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
        time.sleep(0.3)
    assert len(server_pids(p.pid)) == 1
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-3000:]
    assert time.monotonic() - t0 < 20
    assert not processes_mentioning(str(tmp_path / "mcp_calculator_server.py").encode())
