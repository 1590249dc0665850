"""Running a click command as a console script: every user error is one message and exit 2;
the checks every command makes of its paths and input arrays; the console its tables print to."""
from __future__ import annotations

import re
import sys
import zipfile
import zlib
from pathlib import Path

import click

from isa.files import check_readable, check_writable

EXIT_BAD_INPUT = 2
LONGEST = 400     # characters of a message line: text echoed from a huge input is cut in its middle


def fail(name: str, message: str, whole: bool = False) -> None:
    text = f"{name}: error: {message if whole else summary(message)}"
    click.echo(printable("\n".join(map(_clip, text.split("\n")))), err=True)
    sys.exit(EXIT_BAD_INPUT)


def printable(text: str) -> str:
    """``text`` with the bytes of a path that is not UTF-8 (decoded by Python as lone
    surrogates, which no stream can encode) shown as ``\\xff`` escapes."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:      # a surrogate that stands for no byte (from escaped JSON text)
        raw = text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def _clip(line: str) -> str:
    """The culprit comes first and the reason often last: keep both ends of a long line."""
    return line if len(line) <= LONGEST else f"{line[:LONGEST - 100]} ... {line[-95:]}"


def summary(message: str) -> str:
    """The first problem with its indented context (a parse error's line and caret); further
    problems (a verifier's list) are counted, not printed."""
    lines = message.splitlines() or [""]
    head = [lines[0]] + [l for l in lines[1:] if l.startswith(" ")][:2]
    rest = [l for l in lines[1:] if not l.startswith(" ")]
    more = f" (and {len(rest)} more problem{'s' if len(rest) != 1 else ''})" if rest else ""
    return head[0] + more + "".join("\n" + l for l in head[1:])


def run_script(command: click.Command, name: str, errors: tuple[type, ...],
               listed: tuple[type, ...] = ()) -> None:
    """Run ``command``; usage errors, ``errors`` and OS errors exit 2 without a traceback.
    Errors of the ``listed`` types are printed whole: each of their lines is a culprit."""
    try:
        command.main(prog_name=name, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.UsageError as e:
        hint = f" (see {name} --help)" if e.ctx is not None else ""
        fail(name, e.format_message().replace("\n", " ") + hint, whole=True)
    except click.ClickException as e:
        fail(name, e.format_message().replace("\n", " "), whole=True)
    except click.exceptions.Abort:
        fail(name, "aborted")
    except listed as e:
        fail(name, str(e), whole=True)
    except errors as e:
        fail(name, str(e) or type(e).__name__)
    except OSError as e:
        fail(name, f"{e.filename or ''}: {e.strerror or e}")


def table_console(width: int):
    """Standard output for rich tables. Rich assumes 80 columns when it is not a terminal,
    too narrow for a table in a log: there, ``width``."""
    from rich.console import Console
    console = Console()
    return console if console.is_terminal else Console(width=width)


# --- what every command checks of its paths and inputs -----------------------------------------

def same_file(a, b) -> bool:
    """Whether paths ``a`` and ``b`` name one file (through symbolic and hard links too)."""
    a, b = Path(a), Path(b)
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def check_not_inputs(outputs: dict[str, str | Path | None], inputs: dict[str, str | Path | None]) -> None:
    """No output (by option) may replace an input (by description) or another output."""
    given = {opt: path for opt, path in outputs.items() if path}
    for n, (opt, path) in enumerate(given.items()):
        for what, other in inputs.items():
            if other and same_file(path, other):
                raise click.ClickException(f"{opt} {path} would overwrite {what}")
        for earlier, other in list(given.items())[:n]:
            if same_file(path, other):
                raise click.ClickException(f"{opt} {path} is also the {earlier} file")


def check_outputs(outputs: dict[str, str | Path | None], inputs: dict[str, str | Path | None]) -> None:
    """Before any work: ``check_not_inputs``, each input that exists a regular file (a FIFO or a
    device, whichever reader meets it, would block or never end; a missing one is its reader's
    to report) and each output writable; else a one-line error."""
    check_not_inputs(outputs, inputs)
    for what, path in inputs.items():
        if path and Path(path).exists():
            try:
                check_readable(path)
            except OSError as e:
                raise click.ClickException(f"{path}: cannot read {what} ({e.strerror})") from None
    for path in outputs.values():
        if path:
            check_writable(path)


STDIO = "-"
NOT_STDIO = "'-' (standard input or output) is not taken here; name a file ('./-' for one named '-')"


def no_empty_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback: an empty path would read as 'not given' (an output silently not
    written, or written to its default, a check not run); '-', which reads as standard input or
    output by convention, is refused where a command does not read or write a stream (rather
    than read or written as a file of that name)."""
    if value == "":
        raise click.BadParameter("an empty path names no file", ctx, param)
    if value == STDIO:
        raise click.BadParameter(NOT_STDIO, ctx, param)
    return value


def stdout_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A click callback for an output that may be standard output: '-' is None (stdout)."""
    return None if value == STDIO else no_empty_path(ctx, param, value)


def positive_int(text: str) -> int | None:
    """``text`` as a positive integer below 2**63 (larger sizes are out of every range), or None.
    ASCII digits only, and few of them: ``str.isdigit`` also takes '²', and int() refuses more
    than 4,300 digits; either would be a traceback."""
    n = size_int(text)
    return n if n else None


def size_int(text: str) -> int | None:
    """``text`` as an integer from 0 to below 2**63, or None (a dimension may be empty)."""
    if not re.fullmatch(r"[0-9]{1,19}", text):
        return None
    n = int(text)
    return n if n < 1 << 63 else None


def read_arrays(path: str | Path) -> dict:
    """The arrays of an ``.npz`` file by name, every one read (which finds a damaged one)."""
    import numpy as np
    try:
        check_readable(path)        # np.load would wait on a FIFO for ever
        if not zipfile.is_zipfile(path):     # np.load would speak of pickles
            raise ValueError("not an .npz archive")
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        with loaded as npz:
            return {k: npz[k] for k in npz.files}
    # a damaged archive fails in zipfile (RuntimeError for flags it reads as encryption or an unknown
    # method), zlib or numpy's reader, whichever meets the damage first
    except (OSError, ValueError, EOFError, RuntimeError, zipfile.BadZipFile, zlib.error) as e:
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise click.ClickException(f"{path}: cannot read inputs ({why})") from None


def version_option():
    """``--version``: the installed dlegion's version, the same for every command."""
    import click
    return click.version_option(package_name="dlegion", message="%(prog)s %(version)s")
