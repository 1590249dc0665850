"""Measuring configurations: those the store already holds are read back, the others run on the
executor (entered only when there is something to run) and are stored one by one as they finish."""
from __future__ import annotations

from contextlib import ExitStack

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dlegion_cc.dse_exec import Job
from dlegion_cc.dse_measure import Config, failed_row

PROGRESS = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())


class Sweep:
    """One model's measurements: ``executor`` (a Pool or Ray, not yet entered) runs what ``store``
    (or None) lacks."""

    def __init__(self, job: Job, executor, store, console: Console):
        self.job, self.executor, self.store, self.console = job, executor, store, console
        self.stack = ExitStack()
        self.entered = None
        self.asked = self.known = self.ran = 0      # configurations asked for, found stored, run

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stack.close()
        if self.store is not None:
            self.store.close()

    def measure(self, configs: list[Config], search: str, say_known: bool = True) -> list[dict]:
        """A row per configuration (in no particular order); ``search`` names what chose them."""
        # A machine no parameters can make (a search's corner) is a failed row, neither run nor stored.
        rows = [failed_row(c, c.error) for c in configs if c.arch is None]
        valid = [c for c in configs if c.arch is not None]
        known = {c: self.store.measured(c.arch) for c in valid} if self.store is not None else {}
        rows += [row for row in known.values() if row is not None]
        todo = [c for c in valid if known.get(c) is None]
        self.asked += len(configs)
        self.known += len(valid) - len(todo)
        if say_known:
            self.say_known()
        if todo:
            rows += self._run(todo, search)
        return rows

    def say_known(self) -> None:
        if self.store is not None:
            self.console.print(f"{self.known} of {self.asked} configuration(s) already measured in "
                               f"{self.store.path}", highlight=False, soft_wrap=True)

    def _run(self, configs: list[Config], search: str) -> list[dict]:
        if self.entered is None:
            self.entered = self.stack.enter_context(self.executor)
        results = self.entered.run(self.job, configs)     # submitted before the progress thread starts
        rows = []
        with Progress(*PROGRESS, console=self.console) as progress:
            task = progress.add_task("compiling and timing", total=len(configs))
            for config, row in results:
                if self.store is not None:
                    self.store.put(config.arch, row, search)
                rows.append(row)
                self.ran += 1
                progress.update(task, advance=1, description=f"done {config.name}")
        return rows
