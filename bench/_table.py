"""How every benchmark prints its table: rich, at full width even into a log file or a pipe."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

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
