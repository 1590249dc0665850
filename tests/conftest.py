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
def cc(monkeypatch, capsys):
    """Run dlegion-cc in this process: (exit status, stderr lines). An uncaught exception (a
    traceback) fails the test by itself."""
    from dlegion_cc import cli

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["dlegion-cc", *map(str, args)])
        capsys.readouterr()
        try:
            cli.main()
            status = 0
        except SystemExit as e:
            status = e.code
        return status, capsys.readouterr().err.splitlines()
    return run
