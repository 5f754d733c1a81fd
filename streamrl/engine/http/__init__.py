"""SGLang-compatible HTTP front-end for streamrl engines (`streamrl serve`) and its client.

`build_app(engine)` / `serve(engine)` expose any streamrl `Engine` with SGLang's native API (and an
OpenAI-compatible subset); `SGLangClient` talks to such a server, or to a real SGLang server.
See docs/http.md.

Names are resolved lazily so that `python -m streamrl.engine.http.server` does not import the server
module twice.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SGLangClient", "SGLangHTTPError", "build_app", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("SGLangClient", "SGLangHTTPError"):
        from . import client

        return getattr(client, name)
    if name in ("build_app", "serve"):
        from . import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
