"""A plain ``pip install .`` installs every package and the data files the tools read: an
editable install runs from the source tree and would not show a subpackage left out."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent
ROOTS = ("isa", "runtime", "dlegion_cc", "models")
# Files the installed tools read besides modules: the grammar and the architecture presets.
DATA_SUFFIXES = (".lark", ".toml")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _packages_in_tree() -> set[str]:
    return {".".join(init.parent.relative_to(ROOT).parts)
            for top in ROOTS for init in (ROOT / top).rglob("__init__.py")}


def _installed(name: str, config: dict) -> bool:
    if isinstance(config.get("packages"), list):
        return name in config["packages"]
    find = config["packages"]["find"]
    return any(fnmatch.fnmatchcase(name, p) for p in find.get("include", ["*"])) \
        and not any(fnmatch.fnmatchcase(name, p) for p in find.get("exclude", []))


def test_every_package_in_the_tree_is_installed():
    config = _setuptools()
    missing = sorted(p for p in _packages_in_tree() if not _installed(p, config))
    assert not missing, f"pyproject.toml installs without {missing}"


def test_the_data_files_the_tools_read_are_installed():
    data = _setuptools()["package-data"]
    missing = []
    for package in _packages_in_tree():
        folder = ROOT / package.replace(".", "/")
        for path in folder.iterdir():
            if path.suffix in DATA_SUFFIXES and not any(fnmatch.fnmatch(path.name, g) for g in data.get(package, [])):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"pyproject.toml installs without {missing}"


def test_a_package_left_out_is_found():
    """The check itself: the list of packages this file replaced, which left out ``canon``."""
    old = {"packages": ["isa", "isa.presets", "runtime", "dlegion_cc", "dlegion_cc.passes", "dlegion_cc.lower",
                        "models"]}
    assert not _installed("dlegion_cc.canon", old)
    assert _installed("dlegion_cc.canon", _setuptools())
