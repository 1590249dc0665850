"""Regenerate the data files of the example programs (seeded, so the bytes never change)."""
from pathlib import Path

import numpy as np

from isa.program import pack

HERE = Path(__file__).parent


def main() -> None:
    rng = np.random.default_rng(2026)
    ternary = rng.integers(-1, 2, size=(64, 32))
    (HERE / "matmul_w2_multicast.s.data").write_bytes(pack(ternary, "w2").tobytes())
    int8 = rng.integers(-128, 128, size=(32, 24))
    (HERE / "matmul_w8.s.data").write_bytes(pack(int8, "i8").tobytes())


if __name__ == "__main__":
    main()
