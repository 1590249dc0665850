"""Every console script reports a usage error as one line and exit status 2."""
import subprocess
import sys

import pytest

SCRIPTS = {"dlegion-cc": "dlegion_cc.cli", "dlegion-run": "runtime.cli", "dlegion-dse": "dlegion_cc.dse",
           "dlegion-generate": "runtime.generate_cli"}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("args", [["--no-such-option"], []])
def test_a_usage_error_is_one_line_naming_the_script(script, args):
    code = f"import sys; sys.argv = [{script!r}] + {args!r}; from {SCRIPTS[script]} import main; main()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: ") and "--help" in lines[0], r.stderr


@pytest.mark.parametrize("command", ["dlegion-cc", "dlegion-run", "dlegion-as", "dlegion-dis", "dlegion-arch",
                                     "dlegion-dse", "dlegion-generate"])
def test_every_command_says_its_version(command):
    from importlib.metadata import entry_points, version
    [script] = [e for e in entry_points(group="console_scripts") if e.name == command]
    module, _, func = script.value.partition(":")
    code = f"import sys; sys.argv = [{command!r}, '--version']; from {module} import {func}; {func}()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{command} {version('dlegion')}"
