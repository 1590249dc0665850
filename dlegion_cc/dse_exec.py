"""Where a sweep's configurations run: a process pool on this machine, or Ray tasks (a local Ray
instance, or a cluster joined by its address).

Both are context managers whose ``run`` yields (configuration, row) as each finishes, so the
caller stores a row the moment it exists. A task that dies is a failed row, never the sweep's end.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import click

from dlegion_cc.dse_measure import Config, evaluate, failed_row


@dataclass(frozen=True)
class Job:
    """What every configuration of a sweep shares: the model, its dims and the compile switches."""

    model: str
    data_files: tuple[str, ...]
    dims: dict
    switches: dict


def _dead(config: Config, e: Exception) -> dict:
    return failed_row(config, f"worker failed: {type(e).__name__}: {e}")


class Pool:
    """``jobs`` worker processes on this machine."""

    def __init__(self, jobs: int):
        self.jobs = jobs

    def __enter__(self):
        self.pool = ProcessPoolExecutor(max_workers=self.jobs)
        return self

    def __exit__(self, *exc):
        self.pool.shutdown(cancel_futures=True)

    def run(self, job: Job, configs: list[Config]) -> Iterator[tuple[Config, dict]]:
        """Submitted now (forking the workers before any thread of the caller's starts), results as
        they finish."""
        futures = {self.pool.submit(evaluate, job.model, c, job.dims, job.switches): c for c in configs}
        return self._results(futures)

    @staticmethod
    def _results(futures: dict) -> Iterator[tuple[Config, dict]]:
        for done in as_completed(futures):
            try:
                yield futures[done], done.result()
            except Exception as e:  # noqa: BLE001 - a worker that died (e.g. out of memory) is one failed row
                yield futures[done], _dead(futures[done], e)


# --- Ray -----------------------------------------------------------------------------------------

def check_address(address: str) -> None:
    """A cluster that does not answer is a one-line error now, not Ray's retries for a minute."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise click.BadParameter(f"{address!r} is not HOST:PORT (or ray://HOST:PORT, or auto)",
                                 param_hint="--address")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise click.BadParameter(f"no Ray cluster answers at {address} ({e.strerror or e})",
                                 param_hint="--address") from None


def _files(job: Job) -> dict[str, bytes] | None:
    """The model and its data files by path relative to the model's folder, to be written next to
    each other on a node that does not share this file system; None when a data file lies outside
    that folder (then the nodes must see the model's own path)."""
    folder = Path(job.model).resolve().parent
    rel = {Path(job.model).name: Path(job.model)}
    for f in job.data_files:
        r = os.path.relpath(Path(f).resolve(), folder)
        if r.startswith(".."):
            return None
        rel[r] = Path(f)
    return {name: path.read_bytes() for name, path in rel.items()}


def _materialized(files: dict[str, bytes], model_name: str) -> str:
    """The model written once per worker host into a folder named by its bytes' hash."""
    digest = hashlib.sha256(b"".join(hashlib.sha256(files[k]).digest() for k in sorted(files))).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"dlegion-dse-{digest[:16]}"
    if not (folder / model_name).exists():
        staging = Path(tempfile.mkdtemp(prefix=folder.name + "."))
        for name, body in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(body)
        try:
            staging.rename(folder)      # the first worker's copy wins; the others drop theirs
        except OSError:
            import shutil
            shutil.rmtree(staging, ignore_errors=True)
    return str(folder / model_name)


def _evaluate_shipped(files, model: str, config: Config, dims: dict, switches: dict) -> dict:
    if files is not None:
        model = _materialized(files, Path(model).name)
    return evaluate(model, config, dims, switches)


class Ray:
    """Ray tasks: a local instance of ``jobs`` CPUs (the machine's when None), or the cluster at
    ``address``."""

    def __init__(self, jobs: int | None, address: str | None):
        self.jobs, self.address = jobs, address

    def __enter__(self):
        import ray
        if self.address:
            check_address(self.address)
        # Ray's own INFO and WARNING lines would bury the sweep's progress.
        try:
            ray.init(address=self.address, num_cpus=None if self.address else self.jobs, include_dashboard=False,
                     logging_level=logging.ERROR, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:     # e.g. "auto" with no cluster here
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise click.ClickException(f"--address {self.address}: {first}" if self.address
                                       else f"cannot start a local Ray instance: {first}") from None
        cpus = int(ray.cluster_resources().get("CPU", 0))
        where = f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"
        click.echo(f"running on {where} ({cpus} CPUs)", err=True)
        self.task = ray.remote(_evaluate_shipped)
        self.shipped = {}
        return self

    def __exit__(self, *exc):
        import ray
        ray.shutdown()

    def _files_ref(self, job: Job):
        import ray
        if job.model not in self.shipped:
            self.shipped[job.model] = ray.put(_files(job))
        return self.shipped[job.model]

    def run(self, job: Job, configs: list[Config]) -> Iterator[tuple[Config, dict]]:
        files = self._files_ref(job)
        pending = {self.task.remote(files, job.model, c, job.dims, job.switches): c for c in configs}
        return self._results(pending)

    @staticmethod
    def _results(pending: dict) -> Iterator[tuple[Config, dict]]:
        import ray
        while pending:
            (done,), _ = ray.wait(list(pending), num_returns=1)
            config = pending.pop(done)
            try:
                yield config, ray.get(done)
            except Exception as e:  # noqa: BLE001 - a task whose worker died is one failed row
                yield config, _dead(config, e)
