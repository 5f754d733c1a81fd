"""`JsonHttpClient.request` retries once, and only, when a pooled connection failed before the request
was written (the server closed it while idle, so it never saw the request), or when the server dropped
the connection of a call that may run twice (pause, resume)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from streamrl.engine.http.client import JsonHttpClient


def _reset_before_write() -> aiohttp.ClientOSError:
    err = aiohttp.ClientOSError(None, "Can not write request body for http://127.0.0.1:1/x")
    err.__cause__ = aiohttp.client_exceptions.ClientConnectionResetError("Cannot write to closing transport")
    return err


class _Flaky(JsonHttpClient):
    def __init__(self, errors: list[BaseException]) -> None:
        super().__init__("http://127.0.0.1:1")
        self.errors, self.calls = errors, 0

    async def _request(self, method: str, path: str, data: bytes | None, headers: Any) -> Any:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return {"ok": True, "body": data}


async def test_a_connection_closed_before_the_write_is_retried_once() -> None:
    c = _Flaky([_reset_before_write()])
    assert await c.request("POST", "/abort", {"rid": "a"}) == {"ok": True, "body": b'{"rid":"a"}'}
    assert c.calls == 2


async def test_a_second_reset_and_other_os_errors_are_raised() -> None:
    c = _Flaky([_reset_before_write(), _reset_before_write()])
    with pytest.raises(aiohttp.ClientOSError):
        await c.request("POST", "/abort", {})
    assert c.calls == 2
    other = aiohttp.ClientOSError(111, "Connection refused")
    c = _Flaky([other])
    with pytest.raises(aiohttp.ClientOSError):
        await c.request("GET", "/health")
    assert c.calls == 1


async def test_a_dropped_connection_is_retried_only_for_a_call_that_may_run_twice() -> None:
    """The server may have seen a request whose connection it dropped: pause / resume go again once,
    a generation does not (it would run twice)."""
    c = _Flaky([aiohttp.ServerDisconnectedError()])
    assert await c.request("POST", "/pause?mode=abort", idempotent=True) == {"ok": True, "body": None}
    assert c.calls == 2
    c = _Flaky([aiohttp.ServerDisconnectedError()])
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await c.request("POST", "/generate", {"text": "1"})
    assert c.calls == 1
    c = _Flaky([aiohttp.ServerDisconnectedError(), aiohttp.ServerDisconnectedError()])
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await c.request("POST", "/resume", idempotent=True)
    assert c.calls == 2
