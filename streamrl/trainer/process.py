"""The run loop's async handle on the trainer: `start_trainer(cfg, model_dir, ...)`.

On CPU the trainer runs in a process of its own (`TrainerProcess`): the rollout manager's event loop
(HTTP to the engines, rewards, the buffer) runs in the driver, and a trainer thread beside it would
share that loop's GIL at every torch op. On a GPU, where the torch ops release the GIL for the
kernels, it runs in a worker thread of the driver (`TrainerThread`). Both have the same async methods
(accumulate, finish_step, save, weights, aclose); each call runs off the event loop.

How a child's weights come back without a copy: the child moves the model's parameters to shared
memory before the first step and sends them to the parent once; the optimizer updates them in place,
so the parent's `weights()` always reads the current weights. The run loop only reads them between
steps (train step -> weight push -> next train step), never while the child writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import signal
import threading
import time
import traceback
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import torch
from tqdm import tqdm

from ..config import TrainerConfig
from ..devices import resolve_device
from ..types import Group
from ..weights.lora import Adapter
from .trainer import Trainer

_groups = msgspec.msgpack.Encoder()
_decode_groups = msgspec.msgpack.Decoder(list[Group])


class TrainerFailed(RuntimeError):
    """The trainer process died (killed, out of memory) or a step raised; `str()` is one line."""


def _serve(conn: Any, cfg: TrainerConfig, model_path: str, kwargs: dict[str, Any]) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when this process stops (and if the
    # parent dies, the pipe closes and the loop below ends).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # tqdm's default lock is a multiprocessing semaphore: if this process is killed (the OOM killer),
    # the parent's resource tracker warns about it after the run's one error line.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(cfg.threads)
    try:
        trainer = Trainer(cfg, model_path, **kwargs)
        trainer.model.share_memory()
        conn.send(("ready", trainer.state_dict_for_engines()))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        if cmd == "stop":
            conn.send(("ok", None))
            return
        try:
            if cmd == "accumulate":
                out: Any = trainer.accumulate(_decode_groups.decode(arg))
            elif cmd == "finish_step":
                out = trainer.finish_step()
            elif cmd == "save":
                out = str(trainer.save(arg[0], optimizer=arg[1], merged=arg[2]))
            else:
                raise ValueError(f"unknown trainer command {cmd!r}")
            conn.send(("ok", out))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class _Handle(ABC):
    """What both layouts share: one worker thread that every call runs in, in order; the version and
    the samples trained so far; the step's compute time (`train_s` in `finish_step`'s stats)."""

    version: int
    tokenizer: Any

    def __init__(self, cfg: TrainerConfig, samples: int) -> None:
        self._exec = ThreadPoolExecutor(1, "trainer", initializer=lambda: torch.set_num_threads(cfg.threads))
        self._train_s = 0.0
        self.samples = samples

    @abstractmethod
    def _do(self, cmd: str, arg: Any) -> Any:
        """Run one trainer command (accumulate, finish_step, save), blocking, in the handle's thread."""

    async def _run(self, cmd: str, arg: Any = None) -> Any:
        t0 = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._exec, self._do, cmd, arg)
        finally:
            self._train_s += time.perf_counter() - t0

    async def accumulate(self, groups: list[Group]) -> None:
        """Forward and backward on part of the next step's batch (see `Trainer.accumulate`)."""
        await self._run("accumulate", groups)

    async def finish_step(self) -> dict[str, Any]:
        """The optimizer step; version + 1. Stats add `version`, `samples_total` and `train_s` (the
        step's compute seconds) to `Trainer.finish_step`'s."""
        stats = await self._run("finish_step")
        self.version += 1
        self.samples += stats["trained_samples"]
        stats |= {"version": self.version, "samples_total": self.samples, "train_s": self._train_s}
        self._train_s = 0.0
        return stats

    async def save(self, out_dir: str | Path, *, optimizer: bool = False, merged: bool = False) -> Path:
        """See `Trainer.save`."""
        return Path(await self._run("save", (str(out_dir), optimizer, merged)))

    @abstractmethod
    def weights(self) -> dict[str, torch.Tensor] | Adapter:
        """The current weights (with LoRA the adapters), for the engines: read between steps only."""

    async def aclose(self) -> None:
        self._exec.shutdown(wait=False)  # a call still running (a cancelled run) ends on its own


class TrainerThread(_Handle):
    """The trainer in this process, computing in a worker thread (a GPU trainer)."""

    def __init__(self, cfg: TrainerConfig, model_path: str, *, samples: int = 0, **kwargs: Any) -> None:
        super().__init__(cfg, samples)
        self.trainer = Trainer(cfg, model_path, **kwargs)
        self.version, self.tokenizer = self.trainer.version, self.trainer.tokenizer

    def _do(self, cmd: str, arg: Any) -> Any:
        if cmd == "save":
            return self.trainer.save(arg[0], optimizer=arg[1], merged=arg[2])
        return getattr(self.trainer, cmd)(*([] if arg is None else [arg]))

    def weights(self) -> dict[str, torch.Tensor] | Adapter:
        return self.trainer.state_dict_for_engines()


class TrainerProcess(_Handle):
    """The trainer in a child process; batches go to it as msgpack, the weights live in shared memory."""

    def __init__(self, cfg: TrainerConfig, model_path: str, *, samples: int = 0, **kwargs: Any) -> None:
        from transformers import AutoTokenizer

        super().__init__(cfg, samples)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.version = kwargs.get("version", 0)
        ctx = mp.get_context("spawn")  # no fork of a process that holds threads and an event loop
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, cfg, model_path, kwargs), name="streamrl-trainer",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._weights: dict[str, torch.Tensor] | Adapter = self._reply()

    def _reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if status == "error":
            raise TrainerFailed(f"trainer process: {value}")
        return value

    def _do(self, cmd: str, arg: Any) -> Any:
        try:
            self._conn.send((cmd, _groups.encode(arg) if cmd == "accumulate" else arg))
        except (BrokenPipeError, ConnectionResetError, OSError):
            raise self._died() from None
        return self._reply()

    def _died(self) -> TrainerFailed:
        """The one line for a trainer process that went away: how it ended, by signal or status."""
        self._proc.join(timeout=5)
        code, pid = self._proc.exitcode, self._proc.pid
        if code is None:
            self._proc.kill()  # its pipe is gone but it runs on: nothing can use it any more
            self._proc.join(timeout=5)
            how = "closed its pipe and was stopped"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with status {code}"
        return TrainerFailed(f"the trainer process (pid {pid}) {how}")

    def weights(self) -> dict[str, torch.Tensor] | Adapter:
        """The child's parameters, shared: current after each `finish_step` returns."""
        return self._weights

    async def aclose(self) -> None:
        # In the handle's one thread: after a call still in flight (a run cancelled mid-step), never
        # beside it on the same pipe.
        await asyncio.get_running_loop().run_in_executor(self._exec, self.close)
        await super().aclose()

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(TrainerFailed, OSError, EOFError):  # it may be dying already
                self._do("stop", None)
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()


def start_trainer(cfg: TrainerConfig, model_path: str, **kwargs: Any) -> TrainerThread | TrainerProcess:
    """A CPU trainer in its own process, a GPU trainer in a thread; `samples`: trained so far (a
    resumed run); the other `kwargs` go to `Trainer`."""
    cls = TrainerProcess if resolve_device(cfg.device) == "cpu" else TrainerThread
    return cls(cfg, model_path, **kwargs)
