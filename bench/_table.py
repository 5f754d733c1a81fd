"""How every benchmark prints its table (rich, at full width even into a log file or a pipe) and writes
its JSON."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*(str(x) for x in r))
    # Off a terminal rich assumes 80 columns and cuts every header to "wall…", which is useless in
    # the log of a benchmark run in the background.
    Console(width=None if sys.stdout.isatty() else 220).print(t)


def write_results(out: str | Path, meta: dict[str, Any], rows: list[dict[str, Any]], *, section: str | None = None,
                  **extra: Any) -> None:
    """`{"meta": meta + python/torch/date, "results": rows, **extra}` into `out`, and say so. With
    `section` (`cpu`, `gpu`) the file holds one such part per machine kind: a GPU run replaces the
    `gpu` part and keeps the CPU figures, and the other way round."""
    import torch

    meta = {**meta, "torch": torch.__version__, "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M")}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"meta": meta, "results": rows, **extra}
    if section:
        old = json.loads(path.read_text()) if path.exists() else {}
        doc = {**({"cpu": old} if "meta" in old else old), section: doc}  # a file from before the parts: the CPU's
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")
