"""tools.python: hostile code in the real sandbox (rollout/sandbox.py) is stopped by its limits, comes
back as an error observation with its cause, leaves the next call working and the host as it was;
normal code runs; what the machine cannot give is a config error. Real processes throughout."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from streamrl.config import ConfigError, ToolsConfig, load_config
from streamrl.config.schema import PythonToolConfig, RolloutConfig
from streamrl.rollout import Runner, ToolBox
from streamrl.rollout.manager import RolloutCounters
from streamrl.rollout.runner import Context, Episode
from streamrl.rollout.sandbox import LAUNCHER, PYTHON_TOOL, Isolation, PythonTool, encode_settings, probe
from streamrl.types import Sample

ISO = probe()
NET = "none" if ISO.network_namespace else "allowed"
# Small limits keep every test within a few seconds on 2 cores.
LIMITS = PythonToolConfig(enabled=True, timeout_s=2.5, cpu_s=1, memory_mb=256, max_processes=8, max_file_mb=4,
                          max_output_bytes=4096, network=NET)
namespaces = pytest.mark.skipif(ISO.mode != "namespaces", reason=f"no namespaces here: {ISO.reason}")


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, uid) of every process on the host."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            uid = d.stat().st_uid
        except OSError:
            continue  # exited while we looked
        out[int(d.name)] = (int(stat[stat.rindex(")") + 2:].split()[1]), uid)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200] or "(zombie)"
    except OSError:
        return "(gone)"


def descendants(pid: int) -> set[int]:
    procs, found, todo = _procs(), set(), [pid]
    while todo:
        parent = todo.pop()
        for p, (pp, _) in procs.items():
            if pp == parent and p not in found:
                found.add(p)
                todo.append(p)
    return found


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


@pytest.fixture(scope="module", autouse=True)
def host_unchanged() -> Iterator[None]:
    """After every test here: no process left (the test process's descendants, the sandbox uid's), no
    mount, no working folder, no memory gone."""
    me, mounts = os.getpid(), Path("/proc/self/mountinfo").read_text()
    nobody_before = {p for p, (_, uid) in _procs().items() if uid == 65534}
    children_before, mem_before = descendants(me), _mem_available()
    tmp_before = set(Path(tempfile.gettempdir()).glob("streamrl-python-*"))
    yield
    deadline = time.monotonic() + 5  # asyncio's child watcher reaps in a thread of its own
    while descendants(me) - children_before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = descendants(me) - children_before
    assert left == set(), {p: _cmdline(p) for p in left}
    assert {p for p, (_, uid) in _procs().items() if uid == 65534} - nobody_before == set()
    assert Path("/proc/self/mountinfo").read_text() == mounts
    assert set(Path(tempfile.gettempdir()).glob("streamrl-python-*")) == tmp_before
    assert _mem_available() > mem_before - (1 << 30)  # other work shares the machine: a loose bound


@pytest.fixture(scope="module")
async def box() -> AsyncIterator[ToolBox]:
    tools = ToolBox(ToolsConfig(functions=["calculator"], timeout_s=0.5, python=LIMITS))
    yield tools
    await tools.aclose()  # its fork server: host_unchanged finds no process left


async def still_works(box: ToolBox) -> None:
    r = await box.call("python", "print(6 * 7)")
    assert (r.observation, r.error, r.cause) == ("42\n", None, None)


async def run(box: ToolBox, code: str, cause: str | None, within_s: float) -> str:
    t0 = time.perf_counter()
    r = await box.call("python", code)
    seconds = time.perf_counter() - t0
    assert r.cause == cause, r.observation
    assert seconds < within_s, f"{seconds:.1f} s"
    if cause is not None:
        assert r.observation.startswith(f"error: {r.error}") and r.error
    await still_works(box)
    return r.observation


# ---- normal code --------------------------------------------------------------------------------------
async def test_normal_code_prints_its_answer(box: ToolBox) -> None:
    assert (await box.call("python", "print(2+2)")).observation == "4\n"
    # OpenAI-style arguments (PYTHON_TOOL's schema); stdout and stderr together, in order
    code = "import sys\nprint('out', flush=True)\nprint('err', file=sys.stderr)"
    assert (await box.call("python", json.dumps({"code": code}))).observation == "out\nerr\n"
    assert box.openai_tools()[0] == PYTHON_TOOL and "python" in box.tools and "calculator" in box.tools
    r = await box.call("python", "1/0")
    assert r.cause == "exit_code" and r.observation.splitlines()[-1] == "ZeroDivisionError: division by zero"


async def test_a_python_call_is_timed_by_tools_python_not_tools_timeout_s(box: ToolBox) -> None:
    assert box.cfg.timeout_s < 1 < box.cfg.python.timeout_s
    await run(box, "import time; time.sleep(1); print('slept')", None, 2)
    assert (await box.call("python", "import time\nwhile True: time.sleep(0.1)")).cause == "timeout"


# ---- hostile code -------------------------------------------------------------------------------------
@namespaces
async def test_a_fork_bomb_stops_at_max_processes(box: ToolBox) -> None:
    seen: list[int] = []
    await still_works(box)  # this test's fork server started (another test's may still be exiting)
    assert box.python is not None and (server := box.python.server.pid) is not None

    async def watch() -> None:  # the fork server's descendants while the bomb runs
        while True:
            seen.append(len(descendants(server)))
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:  # watched during the call alone: the next call's processes may start before the bomb's are reaped
        t0 = time.perf_counter()
        r = await box.call("python", "import os\nwhile True:\n    os.fork()")
    finally:
        watcher.cancel()
    assert r.cause == "processes" and time.perf_counter() - t0 < 4, r.observation
    assert "BlockingIOError" in r.observation
    await still_works(box)
    # the code's processes, plus the call's launcher and the namespace's init
    assert seen and max(seen) <= LIMITS.max_processes + 2
    # exactly max_processes, itself included; the children it leaves die with it
    code = ("import os, time\nn = 0\nwhile True:\n    try:\n        if os.fork() == 0:\n            time.sleep(60)\n"
            "        n += 1\n    except BlockingIOError:\n        break\nprint(n)")
    assert await run(box, code, None, 2) == f"{LIMITS.max_processes - 1}\n"


async def test_an_endless_loop_runs_out_of_cpu_time(box: ToolBox) -> None:
    await run(box, "while True: pass", "cpu", LIMITS.cpu_s + 1.5)


async def test_a_10_gb_allocation_is_a_memory_error(box: ToolBox) -> None:
    out = await run(box, "x = bytearray(10 * 1024**3)", "memory", 2)
    assert out.rstrip().endswith("MemoryError")


@namespaces
async def test_no_network_not_even_the_hosts_loopback(box: ToolBox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        await run(box, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", "network", 2)
        await run(box, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)", "network", 2)
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing came in


@namespaces
async def test_no_writing_outside_its_own_fresh_folder(box: ToolBox, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)  # not even where everyone may write
    for target in (Path("/dev/shm/escaped"), Path("/var/tmp/escaped"), Path(__file__).with_name("escaped.py"),
                   Path.home() / "escaped"):
        out = await run(box, f"open({str(target)!r}, 'w').write('x')", "exit_code", 2)
        assert "Read-only file system" in out and not target.exists()
    await run(box, "import os\nos.remove(os.__file__)", "exit_code", 2)
    # the host's /tmp is not there: its /tmp is its own working folder, new for every call
    out = await run(box, f"open({str(tmp_path / 'escaped')!r}, 'w')", "exit_code", 2)
    assert "FileNotFoundError" in out and not (tmp_path / "escaped").exists()
    out = await run(box, "import os\nopen('/tmp/mine', 'w').write('x')\nprint(os.getcwd(), os.listdir())", None, 2)
    assert out == "/tmp ['mine']\n" and not Path("/tmp/mine").exists()
    assert await run(box, "import os\nprint(os.listdir())", None, 2) == "[]\n"


async def test_a_file_over_max_file_mb(box: ToolBox) -> None:
    await run(box, "open('big', 'wb').write(b'x' * (5 << 20))", "file_size", 2)


@namespaces
async def test_memory_no_rlimit_bounds_is_refused(box: ToolBox) -> None:
    # memfd files and SysV IPC would hold memory outside RLIMIT_AS (SysV's past the call): seccomp
    code = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
try:
    os.memfd_create("m")
except PermissionError:
    print("memfd_create refused")
for name, args in (("shmget", (0, 1 << 30, 0o1600)), ("msgget", (0, 0o1600)), ("semget", (0, 1, 0o1600))):
    print(name, getattr(libc, name)(*args), os.strerror(ctypes.get_errno()))
"""
    assert await run(box, code, None, 2) == "memfd_create refused\n" + "".join(
        f"{name} -1 Operation not permitted\n" for name in ("shmget", "msgget", "semget"))


async def test_it_cannot_read_the_parents_environment(box: ToolBox, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"sandbox-secret-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("STREAMRL_TEST_SECRET", secret)
    code = f"""import os
print(sorted(os.environ))
for pid in ({os.getpid()}, {os.getppid()}, 1, "self"):
    try:
        print(open(f"/proc/{{pid}}/environ").read())
    except OSError as e:
        print(type(e).__name__)
"""
    out = await run(box, code, None, 2)
    assert secret not in out and "STREAMRL_TEST_SECRET" not in out
    assert out.splitlines()[0] == "['HOME', 'LANG', 'PATH']"


@namespaces
async def test_it_cannot_signal_its_parent_or_the_test(box: ToolBox) -> None:
    out = await run(box, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", "exit_code", 2)
    assert "PermissionError" in out
    out = await run(box, f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)", "exit_code", 2)
    assert "ProcessLookupError" in out  # the test process is not in its PID namespace
    # every process it may signal is its own: it sees none of the host's
    assert await run(box, "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))",
                     None, 2) == "[1, 2]\n"
    await run(box, "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')", "exit_code", 2)
    await run(box, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "killed", 2)


async def test_100_mb_of_output_is_cut_and_killed(box: ToolBox) -> None:
    out = await run(box, "import sys\nsys.stdout.write('x' * (100 << 20))", "output_limit", 2)
    assert len(out) < LIMITS.max_output_bytes + 200 and out.endswith(f"[output cut at {LIMITS.max_output_bytes} bytes]")
    await run(box, "while True: print('y' * 1000)", "output_limit", 2)


async def test_stdin_is_empty(box: ToolBox) -> None:
    assert await run(box, "import sys\nprint(repr(sys.stdin.read()))", None, 2) == "''\n"
    assert "EOFError" in await run(box, "input()", "exit_code", 2)


async def test_a_cancelled_call_leaves_no_process(box: ToolBox) -> None:
    before = descendants(os.getpid())
    call = asyncio.create_task(box.call("python", "import time\ntime.sleep(30)"))
    await asyncio.sleep(0.5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert box.python is not None and box.python.server.pid is not None
    assert descendants(os.getpid()) - {box.python.server.pid} <= before  # only the fork server stays
    await still_works(box)


async def test_a_killed_fork_server_is_an_error_observation_and_the_next_call_starts_another(box: ToolBox) -> None:
    await still_works(box)
    assert box.python is not None and (first := box.python.server.pid) is not None
    call = asyncio.create_task(box.call("python", "import time\ntime.sleep(30)"))
    await asyncio.sleep(0.3)
    os.kill(first, signal.SIGKILL)
    r = await asyncio.wait_for(call, 10)  # at its timeout, its session killed: an error, not a hang
    assert r.error is not None
    await still_works(box)
    assert box.python.server.pid not in (None, first)


def test_a_run_killed_mid_call_leaves_no_sandbox_behind(tmp_path: Path) -> None:
    """SIGKILL to the process that owns the tool while a call runs: its fork server reads the end of its
    socket, kills the call's session and exits."""
    script = tmp_path / "owner.py"
    script.write_text(f"""
import asyncio, sys
from streamrl.config.schema import PythonToolConfig
from streamrl.rollout.sandbox import PythonTool
tool = PythonTool(PythonToolConfig(enabled=True, timeout_s=60, network={NET!r}))
async def main():
    call = asyncio.create_task(tool.run("import time\\nprint('started', flush=True)\\ntime.sleep(60)"))
    while tool.server.pid is None:
        await asyncio.sleep(0.01)
    print(tool.server.pid, flush=True)
    await call
asyncio.run(main())
""")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    server = int(owner.stdout.readline())
    deadline = time.monotonic() + 10
    while len(descendants(server)) < 3 and time.monotonic() < deadline:  # launcher, init, code
        time.sleep(0.02)
    calls = descendants(server)
    assert len(calls) >= 3
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 5
    while (_procs().keys() & (calls | {server})) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _procs().keys() & (calls | {server}) == set()


# ---- counted by cause ---------------------------------------------------------------------------------
async def test_tool_errors_are_counted_by_cause(box: ToolBox) -> None:
    counters = RolloutCounters()
    runner = Runner(None, RolloutConfig(), counters, lambda key: 0)  # type: ignore[arg-type]
    ep = Episode(Context(runner, tokenizer=None, tools=box), Sample(group_id="g", prompt_ids=[1]), {})
    for code in ("print(1)", "x = bytearray(10 * 1024**3)", "1/0", "2/0"):
        await ep.run_tool("python", code, lambda c: box.call("python", c))
    assert await ep.run_tool("calculator", "1+", lambda a: box.call("calculator", a)) == (
        "error: ValueError: not arithmetic: '1+'")
    assert (counters.tool_calls, counters.tool_errors) == (5, 4)
    assert counters.tool_error_causes == {"memory": 1, "exit_code": 2, "exception": 1}


# ---- without namespaces: rlimits and the audit hook -----------------------------------------------------
def _interpreter_for_nobody() -> tuple[str, str] | None:
    """The run's own Python where the code keeps our uid; as root, a Python nobody may run."""
    if os.getuid() != 0:
        return None
    found = shutil.which("python3", path="/usr/bin:/bin")
    return (os.path.realpath(found), "/usr") if found else None


async def test_without_namespaces_the_audit_hook_keeps_it_in_its_folder(tmp_path: Path) -> None:
    cfg = msgspec.structs.replace(LIMITS, network="allowed")
    try:
        tool = PythonTool(cfg, isolation=Isolation("rlimits", False, "forced by the test"),
                          python=_interpreter_for_nobody())
    except ConfigError as e:
        pytest.skip(str(e))
    try:
        assert await tool.run("print(2+2)") == "4\n"
        assert await tool.run("open('mine', 'w').write('x')\nprint(open('mine').read())") == "x\n"
        for code, says in ((f"open({str(tmp_path / 'escaped')!r}, 'w')", "no writing outside"),
                           ("import os\nos.fork()", "os.fork is not allowed"),
                           ("import ctypes", "no _ctypes"),
                           (f"import os\nos.kill({os.getpid()}, 9)", "no signals"),
                           (f"open('/proc/{os.getpid()}/environ').read()", "no other process's /proc"),
                           ("import subprocess\nsubprocess.run(['true'])", "sandbox: ")):
            with pytest.raises(Exception) as info:
                await tool.run(code)
            assert getattr(info.value, "cause", None) == "exit_code" and says in info.value.output
        assert not (tmp_path / "escaped").exists()
        with pytest.raises(Exception) as info:
            await tool.run("bytearray(10 * 1024**3)")
        assert getattr(info.value, "cause", None) == "memory"
    finally:
        await tool.aclose()  # its fork server


@namespaces
def test_a_launcher_that_is_not_root_makes_the_same_sandbox() -> None:
    """The path of a user who is not root (a user namespace first, for the capabilities), taken here by
    starting the launcher as nobody with a Python nobody may run."""
    python, setpriv = _interpreter_for_nobody(), shutil.which("setpriv")
    if python is None or setpriv is None:
        pytest.skip("needs root, setpriv and a Python every user may run")
    tool = PythonTool(LIMITS, python=python)
    code = """import os, socket
print(os.getuid(), os.getcwd(), sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
for attempt in (lambda: open("/var/tmp/escaped", "w"), lambda: socket.create_connection(("1.1.1.1", 53), 1),
                lambda: os.memfd_create("m")):
    try:
        attempt()
        print("made")
    except OSError as e:
        print(e.strerror)
"""
    p = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", python[0], "-I", "-S",
                        str(LAUNCHER), encode_settings(tool.settings(None)), code],
                       capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["65534 /tmp [1, 2]", "Read-only file system", "Network is unreachable",
                                     "Operation not permitted"]
    assert not Path("/var/tmp/escaped").exists()


# ---- configuration --------------------------------------------------------------------------------------
def test_config_keys_and_errors() -> None:
    cfg = load_config(None, ["tools.python.enabled=true", "tools.python.cpu_s=3", "tools.python.network=allowed"])
    assert cfg.tools.python.enabled and cfg.tools.python.cpu_s == 3 and cfg.tools.python.network == "allowed"
    assert load_config(None).tools.python == PythonToolConfig()  # off by default
    for override, key in (("tools.python.network=host", "tools.python.network"),
                          ("tools.python.memory_mb=1", "tools.python.memory_mb"),
                          ("tools.python.max_procs=3", "tools.python")):
        with pytest.raises(ConfigError) as info:
            load_config(None, [override])
        assert key in str(info.value) and "\n" not in str(info.value)


def test_no_network_namespace_is_a_config_error_unless_network_allowed() -> None:
    weak = Isolation("rlimits", False, "user namespaces refused")
    with pytest.raises(ConfigError) as info:
        PythonTool(msgspec.structs.replace(LIMITS, network="none"), isolation=weak)
    msg = str(info.value)
    assert msg.startswith("config error: tools.python.network: ") and "\n" not in msg and "allowed" in msg
    with pytest.raises(ConfigError, match="tools.python.enabled"):
        ToolBox(ToolsConfig(functions=["python=tests/rewards_for_tests.py:length_reward"], python=LIMITS))
