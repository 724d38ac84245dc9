"""The progress bar of ``rd2h demo`` and ``rd2h demo --vllm`` (rich, on stderr)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool, description: str = "moving KV") -> Iterator[Any]:
    """A rich progress bar on stderr (a no-op when disabled or not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not enabled or not console.is_terminal,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
