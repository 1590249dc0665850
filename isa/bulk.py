"""Building millions of small objects without the cycle collector.

Parsing a whole model's program, expanding it into one task per Legion and timing it create
millions of instructions, conditions and tuples that stay alive to the end. Each allocation
burst triggers the cycle collector, whose older generations walk every object made so far:
on a 30-layer model that doubled the time of expansion and grew with the program. None of these
objects form cycles, so collection waits until the work is done.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def no_cycle_collection():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
