"""Progress of long work on stderr: a rich bar while stderr is a terminal, nothing otherwise.

Every command that can take more than a couple of seconds makes one :class:`Progress` from its
``-q/--quiet`` flag and hands it down to the work; code that is given none reports to
:data:`SILENT`. Bars are transient: they leave no lines behind, so the output a user keeps (a
report, a table) reads the same with and without them.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

Advance = Callable[[int], None]


class Progress:
    """Reports named tasks of known size; disabled, it costs one call per step and prints nothing."""

    def __init__(self, enabled: bool, console=None):
        self.enabled = enabled
        self.console = console
        self._bar = None

    @classmethod
    def for_terminal(cls, quiet: bool = False) -> "Progress":
        """On when stderr is a terminal and the user did not ask for quiet."""
        return cls(not quiet and sys.stderr.isatty())

    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Advance]:
        """A task of ``total`` steps (None: unknown); yields ``advance(steps=1)``."""
        if not self.enabled:
            yield _nothing
            return
        with self._open() as bar:
            tid = bar.add_task(description, total=total)
            try:
                yield lambda steps=1: bar.advance(tid, steps)
            finally:
                bar.remove_task(tid)

    @contextmanager
    def _open(self):
        """One live display for nested tasks: rich allows one at a time per console."""
        if self._bar is not None:
            yield self._bar
            return
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        console = self.console or Console(stderr=True)
        with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                 TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
            self._bar = bar
            try:
                yield bar
            finally:
                self._bar = None


def _nothing(steps: int = 1) -> None:
    pass


SILENT = Progress(False)
