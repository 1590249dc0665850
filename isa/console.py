"""Running a click command as a console script: every user error is one message and exit 2;
the console its tables print to."""
from __future__ import annotations

import sys

import click

EXIT_BAD_INPUT = 2
LONGEST = 400     # characters of a message line: text echoed from a huge input is cut in its middle


def fail(name: str, message: str, whole: bool = False) -> None:
    text = f"{name}: error: {message if whole else summary(message)}"
    click.echo("\n".join(map(_clip, text.split("\n"))), err=True)
    sys.exit(EXIT_BAD_INPUT)


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
