"""A verifiers environment, served to streamrl over stdin/stdout: run by verifiers' own Python (its own
environment, `.venv-verifiers`: verifiers pins openai<3 and mcp==2.0.0, which the project's openai-agents
cannot share), never imported by streamrl. It imports only the standard library and `verifiers`.

    python verifiers_bridge.py SPEC_JSON
    -> {"ready": true, "tasks": [{"idx", "prompt", "system_prompt", "name"}, ...]}   or {"error": "..."}, exit 1
    <- {"id": N, "op": "run", "idx": I, "base_url": URL}    one episode of task I, its model at URL
    -> {"id": N, "reward": R, "rewards": {...}, "metrics": {...}, "error": null | "..."}

SPEC: `{"env": ID or "module:function" or "file.py:function", "args": {...}, "local_python": bool}`. An id
is a taskset id (verifiers' own loading: `resolve_env_config` + `load_environment`, `args` the env config's
fields); a function is called with `args` and returns a `vf.Env`. The episodes run the environment's own
`Env.run_episode` (its harness, tools, rubric) inside `Env.serving()`; their model is an eval client
(verifiers' relay of native OpenAI requests) pointed at `base_url`, streamrl's capture endpoint for the
episode, which records every model turn as the engine's token ids. Episodes run side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path
from typing import Any


def load_env(spec: dict[str, Any]) -> Any:
    import verifiers.v1 as vf

    target, args = spec["env"], dict(spec.get("args") or {})
    if ":" not in target:
        data = dict(args)
        data["taskset"] = {**(data.get("taskset") or {}), "id": target}
        return vf.load_environment(vf.resolve_env_config(data))
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"cannot import {where}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    env = getattr(module, name)(**args)
    if not isinstance(env, vf.Env):
        raise TypeError(f"{target} returned a {type(env).__name__}, not a verifiers.v1.Env")
    return env


def use_own_python() -> None:
    """Local (subprocess) runtimes run verifiers' bundled programs (the chat loop of the `null` and `bash`
    harnesses) with this Python, which has every dependency they declare, instead of syncing a uv
    environment per script: that needs uv and the network on the machine, and a first call per machine."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    async def prepare(self: Any, script: str | bytes, env: dict[str, str] | None = None, *,
                      activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{id(self)}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic: episodes preparing the same script at once never read half of it
        return [sys.executable, str(path)]

    SubprocessRuntime.prepare_uv_script = prepare  # type: ignore[method-assign]


def task_row(task: Any) -> dict[str, Any]:
    d = task.data
    prompt = d.prompt if isinstance(d.prompt, str) or d.prompt is None else [
        m.model_dump(mode="json", exclude_none=True) for m in d.prompt]
    return {"idx": d.idx, "prompt": prompt, "system_prompt": d.system_prompt, "name": d.name}


class Bridge:
    def __init__(self, env: Any, tasks: list[Any]) -> None:
        self.env, self.tasks = env, tasks
        self.out_lock = asyncio.Lock()

    async def send(self, obj: dict[str, Any]) -> None:
        async with self.out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    async def run(self, req: dict[str, Any]) -> None:
        import verifiers.v1 as vf

        out: dict[str, Any] = {"id": req["id"], "reward": None, "rewards": {}, "metrics": {}, "error": None}
        try:
            # A client per episode: its base URL is the episode's own session on the capture endpoint.
            client = vf.EvalClientConfig(base_url=req["base_url"], api_key_var="STREAMRL_VERIFIERS_KEY")
            ctx = vf.ModelContext(model="policy", client=client)
            episode = await self.env.run_episode(self.tasks[req["idx"]], ctx)
            traces = list(episode.traces)
            errors = [f"{e.type}: {e.message}" for t in traces for e in t.errors]
            errors += [f"{e.type}: {e.message}" for e in episode.errors]
            if errors:
                out["error"] = "; ".join(errors)
            else:
                out["reward"] = sum(t.reward for t in traces)
                for t in traces:
                    out["rewards"] |= {k: r.value for k, r in t.rewards.items() if r is not None}
                    out["metrics"] |= {k: v for k, v in (t.metrics or {}).items() if isinstance(v, int | float)}
        except Exception as e:  # noqa: BLE001 - one episode's failure is its answer, the bridge goes on
            out["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        await self.send(out)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        running: set[asyncio.Task[None]] = set()
        serving = self.env.serving()
        try:
            await serving.__aenter__()  # its tool servers and interception server: a failure is a load failure
        except Exception as e:  # noqa: BLE001 - said in one line, in full on stderr
            traceback.print_exc(file=sys.stderr)
            await self.send({"error": f"{type(e).__name__}: {first_line(e)}"})
            sys.exit(1)
        try:
            await self.send({"ready": True, "tasks": [task_row(t) for t in self.tasks]})
            while line := await reader.readline():
                req = json.loads(line)
                if req.get("op") == "run":
                    task = asyncio.create_task(self.run(req))
                    running.add(task)
                    task.add_done_callback(running.discard)
            for task in running:  # stdin closed: streamrl is gone, so are its episodes' endpoints
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*running, return_exceptions=True)
        finally:
            await serving.__aexit__(None, None, None)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def main() -> None:
    spec = json.loads(sys.argv[1])
    try:
        if spec.get("local_python", True):
            use_own_python()
        env = load_env(spec)
        tasks = list(env.taskset)
        if not tasks:
            raise ValueError("its taskset has no tasks")
    except BaseException as e:  # noqa: BLE001 - any failure to load is the one line streamrl shows
        if isinstance(e, KeyboardInterrupt):
            raise
        sys.stdout.write(json.dumps({"error": f"{type(e).__name__}: {first_line(e)}"}) + "\n")
        sys.stdout.flush()
        traceback.print_exc(file=sys.stderr)
        sys.exit(1)
    asyncio.run(Bridge(env, tasks).serve())


if __name__ == "__main__":
    main()
