"""verifiers environments as streamrl rollouts (`rollout.environment: verifiers`): the environment's taskset
gives the prompts, its own `Env.run_episode` (its harness's turn logic, its tools) runs each episode, and
its rewards score it; streamrl records every model turn.

verifiers lives in an environment of its own (`.venv-verifiers`, scripts/setup_verifiers.sh): it pins
openai<3 and mcp==2.0.0, which the project's openai-agents (openai>=3) cannot share. A bridge process there
(rollout/verifiers_bridge.py) holds the environment for the whole run; each episode's model is verifiers'
eval client (its relay of native OpenAI requests, through its interception server) pointed at the
episode's own session of the capture endpoint (rollout/capture/). So every model turn is one
`episode.generate()`: the engine's token ids, logprobs and versions, nothing re-tokenized, resumed across
weight updates; what the environment writes (system prompt, tool results) is appended masked.

    env = VerifiersEnv.open(cfg.rollout.verifiers, log_path)   before any work: a ConfigError in one line
    task = env.task(eval_size)                                 records: {"prompt", "vf_idx"}
    workflow = VerifiersWorkflow(env)                          the manager's workflow for every sample

Nothing here imports verifiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import subprocess
import threading
from pathlib import Path
from typing import IO, Any

from ..config import ConfigError, VerifiersConfig
from ..procs import find_side_python
from ..tasks import Task
from .runner import Episode

ENV_PYTHON = "STREAMRL_VERIFIERS_PYTHON"
DEFAULT_VENV = ".venv-verifiers"
BRIDGE = Path(__file__).with_name("verifiers_bridge.py")
INSTALL = "run `bash scripts/setup_verifiers.sh` (builds .venv-verifiers) or point rollout.verifiers.python at one"


def find_verifiers_python(explicit: str | None = None) -> str | None:
    """The Python that has verifiers (`explicit`, $STREAMRL_VERIFIERS_PYTHON or .venv-verifiers;
    procs.find_side_python)."""
    return find_side_python(explicit, ENV_PYTHON, DEFAULT_VENV)


class EnvironmentFailed(RuntimeError):
    """The environment could not finish an episode (its harness, a tool server, its rewards): the group fails."""


class VerifiersEnv:
    """The bridge process of a run: started (and its tasks read) by `open`, episodes by `run`. A reader
    thread hands each answer to the episode that waits for it, so `open` needs no event loop."""

    def __init__(self, proc: subprocess.Popen[str], tasks: list[dict[str, Any]], lines: queue.Queue[str | None],
                 log: IO[str]) -> None:
        self.proc, self.tasks, self._lines, self._log = proc, tasks, lines, log
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[dict[str, Any]]]] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._deliver, name="verifiers-bridge", daemon=True)
        self._reader.start()

    @classmethod
    def open(cls, cfg: VerifiersConfig, log_path: Path) -> VerifiersEnv:
        """Start the bridge and wait until the environment has loaded and listed its tasks; a ConfigError in one
        line (naming rollout.verifiers.*) when verifiers is missing or the environment does not load."""
        if not cfg.env:
            raise ConfigError("rollout.verifiers.env", "rollout.environment: verifiers needs an environment: a "
                                                       "taskset id or 'module:function'")
        python = find_verifiers_python(cfg.python)
        if python is None:
            where = f"'{cfg.python}' does not exist" if cfg.python else "no Python with verifiers was found"
            raise ConfigError("rollout.verifiers.python", f"{where}; {INSTALL}")
        target = cfg.env
        where, sep, _ = target.rpartition(":")
        paths = [os.getcwd()]
        if sep and where.endswith(".py"):  # a file: its folder is importable too (its tool servers import it)
            target = f"{Path(where).resolve()}:{target.rpartition(':')[2]}"
            paths.insert(0, str(Path(where).resolve().parent))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
        spec = {"env": target, "args": cfg.args, "local_python": cfg.local_python}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("a")
        proc = subprocess.Popen([python, str(BRIDGE), json.dumps(spec)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, env=env,
                                start_new_session=True)  # a Ctrl-C reaches streamrl, which closes it
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name="verifiers-bridge-out", daemon=True).start()
        try:
            first = lines.get(timeout=cfg.startup_timeout_s)
        except queue.Empty:
            first = None
            problem = f"did not load within {cfg.startup_timeout_s:g} s (rollout.verifiers.startup_timeout_s)"
        else:
            msg = _parse(first) if first is not None else {}
            problem = (None if msg.get("ready") else
                       msg.get("error") or f"its process exited (code {proc.wait()}) before listing its tasks")
            if problem is None:
                return cls(proc, list(msg["tasks"]), lines, log)
        _stop(proc)
        log.close()
        raise ConfigError("rollout.verifiers.env", f"{cfg.env}: the environment does not load: {problem} "
                                                   f"(details in {log_path})")

    def task(self, eval_size: int) -> Task:
        """The environment's tasks as a run's prompts: the first `eval_size` (at most a fifth) held out. A record
        is `{"prompt", "vf_idx"}`: the task's prompt (as streamrl shows it; the episode's real prompt is what
        the environment's harness sends first) and its place in the taskset."""
        records = [{"prompt": _prompt_of(t), "vf_idx": t["idx"], "answer": ""} for t in self.tasks]
        n_eval = min(eval_size, len(records) // 5)
        return Task(train=records[n_eval:], held_out=records[:n_eval], reward_fn=_scored_by_the_environment)

    async def run(self, idx: int, base_url: str) -> dict[str, Any]:
        """One episode of task `idx` whose model is at `base_url`: `{"reward", "rewards", "metrics", "error"}`."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        with self._lock:
            self._next += 1
            rid = self._next
            self._pending[rid] = (loop, fut)
        try:
            self._send({"id": rid, "op": "run", "idx": idx, "base_url": base_url})
            return await fut
        finally:
            with self._lock:
                self._pending.pop(rid, None)

    def _send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise EnvironmentFailed(f"the verifiers environment's process is gone (code {self.proc.poll()})") from None

    def _deliver(self) -> None:
        while (line := self._lines.get()) is not None:
            msg = _parse(line)
            with self._lock:
                waiting = self._pending.get(msg.get("id", -1))
            if waiting is not None:
                loop, fut = waiting
                loop.call_soon_threadsafe(_settle, fut, msg)
        with self._lock:  # the process ended: nobody gets an answer now
            waiting_all = list(self._pending.values())
        gone = EnvironmentFailed(f"the verifiers environment's process exited (code {self.proc.wait()})")
        for loop, fut in waiting_all:
            with contextlib.suppress(RuntimeError):  # a loop already closed
                loop.call_soon_threadsafe(_settle, fut, gone)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        _stop(self.proc)
        self._log.close()


class VerifiersWorkflow:
    """The workflow of `rollout.environment: verifiers`: the sample is one episode of the environment, its model
    the episode's capture session. The episode's score is the sample's reward (`meta["env_reward"]`)."""

    def __init__(self, env: VerifiersEnv) -> None:
        self.env = env

    async def __call__(self, record: dict[str, Any], episode: Episode) -> None:
        out = await self.env.run(int(record["vf_idx"]), await episode.openai_url())
        if out.get("error"):
            raise EnvironmentFailed(f"verifiers episode of task {record['vf_idx']}: {out['error']}")
        meta = episode.sample.meta
        meta["env_reward"] = float(out["reward"])
        meta["env_rewards"] = out.get("rewards") or {}
        if out.get("metrics"):
            meta["env_metrics"] = out["metrics"]


def _scored_by_the_environment(response: str, answer: Any) -> float:
    raise RuntimeError("a verifiers environment scores its own episodes (the sample's meta['env_reward'])")


def _prompt_of(task: dict[str, Any]) -> str | list[dict[str, Any]]:
    prompt = task.get("prompt")
    if isinstance(prompt, list):
        return ([{"role": "system", "content": task["system_prompt"]}] if task.get("system_prompt") else []) + prompt
    text = prompt or ""
    return [*([{"role": "system", "content": task["system_prompt"]}] if task.get("system_prompt") else []),
            {"role": "user", "content": text}]


def _parse(line: str) -> dict[str, Any]:
    try:
        msg = json.loads(line)
    except ValueError:
        return {"error": f"unreadable line from the bridge: {line.strip()[:200]}"}
    return msg if isinstance(msg, dict) else {"error": f"unexpected message from the bridge: {line.strip()[:200]}"}


def _settle(fut: asyncio.Future[dict[str, Any]], result: dict[str, Any] | BaseException) -> None:
    if fut.done():
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Close its stdin (the bridge ends its episodes and exits), then make sure."""
    with contextlib.suppress(OSError, ValueError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


__all__ = ["EnvironmentFailed", "VerifiersEnv", "VerifiersWorkflow", "find_verifiers_python"]
