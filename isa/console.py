"""Running a click command as a console script: every user error is one message and exit 2."""
from __future__ import annotations

import sys

import click

EXIT_BAD_INPUT = 2


def fail(name: str, message: str) -> None:
    click.echo(f"{name}: error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def run_script(command: click.Command, name: str, errors: tuple[type, ...]) -> None:
    """Run ``command``; usage errors, ``errors`` and OS errors exit 2 without a traceback."""
    try:
        command.main(prog_name=name, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_BAD_INPUT)
    except click.exceptions.Abort:
        fail(name, "aborted")
    except errors as e:
        fail(name, str(e) or type(e).__name__)
    except OSError as e:
        fail(name, f"{e.filename or ''}: {e.strerror or e}")
