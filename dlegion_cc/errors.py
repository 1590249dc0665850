"""Compiler errors: each names the model and the culprit node, and exits with status 2."""
from __future__ import annotations


class CompileError(Exception):
    """A model that cannot be compiled; the message is complete and user-facing."""


def node_error(source: str, node_name: str, op: str, reason: str) -> CompileError:
    return CompileError(f"{source}: node '{node_name}' ({op}): {reason}")


class UnsupportedNodes(CompileError):
    """Every node that cannot be compiled, reported at once."""

    def __init__(self, source: str, problems: list[tuple[str, str, str]]):
        self.problems = problems
        lines = [f"{source}: node '{n}' ({op}): {why}" for n, op, why in problems]
        super().__init__("\n".join(lines))
