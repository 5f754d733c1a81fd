"""The trainer in a process of its own, driven like the in-process `Trainer`.

Why: the rollout manager's event loop (HTTP to the engines, rewards, the buffer) runs in the driver.
A trainer thread beside it shares that loop's GIL at every torch op: in bench/async_vs_sync.py
(eta = 4), while the trainer was the bottleneck, the run took 1.25x as long with the trainer as a thread.
Once the trainer got cheaper (length-bucketed micro-batches) the two layouts measured the same.

How the weights come back without a copy: the child moves the model's parameters to shared memory
before the first step and sends them to the parent once; the optimizer updates them in place, so the
parent's `state_dict_for_engines()` always reads the current weights. The run loop only reads them
between steps (train step -> weight push -> next train step), never while the child writes.

CPU only: on a GPU the in-process `Trainer` is used (`run.py` decides).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import traceback
from pathlib import Path
from typing import Any

import msgspec
import torch

from ..types import Group
from .trainer import Trainer, TrainerSettings

_groups = msgspec.msgpack.Encoder()
_decode_groups = msgspec.msgpack.Decoder(list[Group])


def _serve(conn: Any, model_path: str, settings: TrainerSettings, threads: int, version: int,
           optimizer_state: str | None) -> None:
    # Ctrl-C reaches the whole process group; the parent decides when this process stops (and if the
    # parent dies, the pipe closes and the loop below ends).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        trainer = Trainer(model_path, settings, version=version, optimizer_state=optimizer_state)
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
        try:
            if cmd == "train":
                out: Any = trainer.train_step(_decode_groups.decode(arg))
            elif cmd == "accumulate":
                out = trainer.accumulate(_decode_groups.decode(arg))
            elif cmd == "finish":
                out = trainer.finish_step()
            elif cmd == "save":
                path, with_optimizer = arg
                out = str(trainer.save(path, optimizer=with_optimizer))
            elif cmd == "stop":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown trainer command {cmd!r}")
            conn.send(("ok", out))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class TrainerProcess:
    """`Trainer`'s interface (train_step, accumulate, finish_step, state_dict_for_engines, save, version,
    tokenizer) with the model and optimizer in a child process. Calls are blocking; run them off the
    event loop."""

    def __init__(self, model_path: str, settings: TrainerSettings, *, threads: int = 1, version: int = 0,
                 optimizer_state: str | Path | None = None) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.version = version
        ctx = mp.get_context("spawn")  # no fork of a process that holds threads and an event loop
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, model_path, settings, threads, version,
                                       None if optimizer_state is None else str(optimizer_state)),
                                 name="streamrl-trainer", daemon=True)
        self._proc.start()
        child.close()
        self._weights: dict[str, torch.Tensor] = self._call_reply()

    def _call_reply(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the trainer process exited (status {self._proc.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"trainer process: {value}")
        return value

    def _call(self, cmd: str, arg: Any = None) -> Any:
        self._conn.send((cmd, arg))
        return self._call_reply()

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        stats = self._call("train", _groups.encode(groups))
        self.version += 1
        return stats

    def accumulate(self, groups: list[Group]) -> None:
        self._call("accumulate", _groups.encode(groups))

    def finish_step(self) -> dict[str, float]:
        stats = self._call("finish")
        self.version += 1
        return stats

    def state_dict_for_engines(self) -> dict[str, torch.Tensor]:
        """The child's parameters, shared: current after each `train_step` returns."""
        return self._weights

    def save(self, out_dir: str | Path, *, optimizer: bool = False) -> Path:
        return Path(self._call("save", (str(out_dir), optimizer)))

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(RuntimeError, OSError, EOFError):  # it may be dying already
                self._call("stop")
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()
