"""Test-suite wide settings and fixtures."""
import sys

import pytest

# Modules whose results pass through fp32 arithmetic that a BLAS kernel could change (the vector
# unit's products, the goldens, bit-for-bit comparisons of two programs): CI runs them again
# under other OpenBLAS kernels (`-m fp32`), and they must pass under every one.
FP32_MODULES = {"test_attention_int8", "test_causal", "test_fdot", "test_golden", "test_models", "test_quant_models",
                "test_rowwise", "test_views", "test_semantics", "test_examples", "test_real_shapes"}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.rpartition(".")[2] in FP32_MODULES:
            item.add_marker(pytest.mark.fp32)


@pytest.fixture
def console(monkeypatch, capsys):
    """Run a console script's ``main`` in this process: ``console(main, name)(*args)`` gives
    (exit status, stdout, stderr lines). An uncaught exception (a traceback) fails the test by
    itself."""
    def script(main, name: str):
        def run(*args):
            monkeypatch.setattr(sys, "argv", [name, *map(str, args)])
            capsys.readouterr()
            try:
                main()
                status = 0
            except SystemExit as e:
                status = e.code
            out = capsys.readouterr()
            return status, out.out, out.err.splitlines()
        return run
    return script


@pytest.fixture
def cc(console):
    """Run dlegion-cc in this process: (exit status, stderr lines)."""
    from dlegion_cc import cli
    script = console(cli.main, "dlegion-cc")

    def run(*args):
        status, _, err = script(*args)
        return status, err
    return run
