"""Token generation with a key/value cache: a prefill program (the prompt, an empty past), then one
decode program per past length (one new token after the cache), each step's ``present`` outputs
fed back as the next step's ``past`` inputs and the next token chosen greedily (the argmax of the
last position's logits). Programs are compiled on demand and kept in a build folder.

The graph is a decode graph in transformers' cache pattern (``past_key_values.N.key/value``
inputs ``[batch, kv_heads, past, head_dim]``, ``present.N.key/value`` outputs), with symbolic
sequence and past dims: the compiler binds every dim, so each past length is its own program."""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from dlegion_cc.canon.gqa import cache_head_dims
from isa.arch import Arch
from isa.progress import SILENT, Progress

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
PAST_AXIS = 2           # [batch, kv_heads, past, head_dim]: the axis a step grows
IDS = "input_ids"
# Inputs Optimum's and onnxruntime-genai's exports add, which the loop fills for one unpadded
# sequence: the mask ones over the past and new tokens, the positions past .. past + sequence - 1.
MASK, POSITIONS = "attention_mask", "position_ids"


class GenerateError(Exception):
    """Bad input for generation (the model, the prompt, the lengths): one line, exit status 2."""


@dataclass(frozen=True)
class CacheGraph:
    """What the loop needs to know of a decode graph: its inputs' shapes (a dim is a size or the
    name of a symbolic dim), which ``past`` input each ``present`` output feeds, and the names of
    the sequence and past dims."""
    path: str
    inputs: dict[str, tuple]
    feeds: dict[str, str]           # present output -> past input
    seq_dim: str
    past_dim: str
    vocab: int | None
    total_dim: str | None = None    # the attention mask's length (past + sequence), if it has one
    int_types: dict = field(default_factory=dict)   # attention_mask / position_ids -> numpy dtype
    fixed: dict = field(default_factory=dict)       # dims the graph itself sizes (a cache's head size)
    # Every past input's past dim: torch.onnx names each layer's its own (s3, s5, ...), all one length.
    past_dims: tuple = ()

    def dims(self, seq: int, past: int) -> dict[str, int]:
        """Every symbolic dim bound for a step of ``seq`` new tokens after ``past`` cached ones:
        the sequence, past and total dims, any other (the batch) 1."""
        named = {d for shape in self.inputs.values() for d in shape if isinstance(d, str)}
        sizes = {**self.fixed, **{d: past for d in self.past_dims or (self.past_dim,)},
                 self.seq_dim: seq, self.total_dim: past + seq}
        return {d: sizes.get(d, 1) for d in sorted(named)}

    def empty_past(self) -> dict[str, np.ndarray]:
        """The cache of a prefill: every past input with no positions."""
        dims = self.dims(1, 0)
        return {name: np.zeros([dims[d] if isinstance(d, str) else d for d in self.inputs[name]], np.float32)
                for name in self.feeds.values()}


def cache_graph(path: str | Path) -> CacheGraph:
    """Read ``path``'s interface (not its weights) and check it is a decode graph generation can
    drive; a GenerateError names what is missing."""
    path = str(path)
    try:
        model = onnx.load(path, load_external_data=False)
    except FileNotFoundError:
        raise GenerateError(f"{path}: no such file") from None
    except Exception as e:  # protobuf decode errors have no common base class
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GenerateError(f"{path}: not an ONNX model ({why})") from None
    weights = {t.name for t in model.graph.initializer}
    inputs = {i.name: _shape(i) for i in model.graph.input if i.name not in weights}
    feeds = {o.name: PAST_PREFIX + o.name[len(PRESENT_PREFIX):] for o in model.graph.output
             if o.name.startswith(PRESENT_PREFIX)}
    _check_interface(path, inputs, feeds)
    total = _symbolic(path, inputs, MASK, 1, "attention mask") if MASK in inputs else None
    types = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
             for i in model.graph.input if i.name in (MASK, POSITIONS)}
    seq = _symbolic(path, inputs, IDS, 1, "sequence")
    pasts = tuple(dict.fromkeys(_symbolic(path, inputs, name, PAST_AXIS, "past") for name in feeds.values()))
    return CacheGraph(path, inputs, feeds, seq, pasts[0], _vocab(model),
                      total, types, cache_head_dims(model), pasts)


def _shape(value) -> tuple:
    return tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None
                 for d in value.type.tensor_type.shape.dim)


def _check_interface(path: str, inputs: dict, feeds: dict) -> None:
    if IDS not in inputs:
        raise GenerateError(f"{path}: no '{IDS}' input (its inputs: {', '.join(inputs) or 'none'})")
    if not feeds:
        raise GenerateError(f"{path}: no '{PRESENT_PREFIX}*' outputs: not a decode graph with a key/value cache "
                            f"(export it with its past, e.g. python -m models.bitnet --past 0 --dynamic)")
    unfed = sorted(set(feeds.values()) - set(inputs))
    if unfed:
        raise GenerateError(f"{path}: the present outputs have no past input(s) {', '.join(unfed)}")
    other = sorted(set(inputs) - set(feeds.values()) - {IDS, MASK, POSITIONS})
    if other:
        raise GenerateError(f"{path}: input(s) {', '.join(other)} are neither '{IDS}', '{MASK}', '{POSITIONS}' "
                            f"nor a past the present outputs feed; generation cannot give them values")
    bad = [n for n in feeds.values() if len(inputs[n] or ()) != 4]
    if bad:
        raise GenerateError(f"{path}: past input '{bad[0]}' is not [batch, kv_heads, past, head_dim]")


def _symbolic(path: str, inputs: dict, name: str, axis: int, what: str) -> str:
    """The name of the symbolic dim at ``axis`` of input ``name``: generation gives it a new size
    at every step, so a fixed size there is refused."""
    shape = inputs[name] or ()
    dim = shape[axis] if axis < len(shape) else None
    if not isinstance(dim, str):
        raise GenerateError(f"{path}: input '{name}' has a fixed {what} length ({dim}); generation needs it "
                            f"symbolic (export with --dynamic)")
    return dim


def _vocab(model: onnx.ModelProto) -> int | None:
    for o in model.graph.output:
        if o.name == "logits":
            last = o.type.tensor_type.shape.dim[-1]
            return last.dim_value if last.HasField("dim_value") else None
    return None


# --- programs, compiled on demand ---------------------------------------------------------------

@dataclass
class Build:
    """Programs of one model for one machine, compiled when first asked for and kept in
    ``folder`` under a name that changes with the model's files, the machine and the options."""
    graph: CacheGraph
    arch: Arch
    arch_name: str
    folder: Path
    attention: str | None = None
    progress: Progress = SILENT
    quantize: str | None = None     # dlegion-cc --quantize: float MatMul weights onto the arrays
    compiled: list = field(default_factory=list)     # (seq, past) compiled by this Build, not found

    def path(self, seq: int, past: int) -> Path:
        return self.folder / f"{Path(self.graph.path).stem}.{self._key()}.s{seq}.p{past}.bin"

    def _key(self) -> str:
        """The model's files (size and time: hashing 11 GB of weights would take longer than a
        compile), the machine's parameters and the options."""
        from dlegion_cc.importer import peek
        _, data = peek(self.graph.path)
        stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in [Path(self.graph.path), *sorted(data)]]
        text = repr((stats, dataclasses.asdict(self.arch), self.attention, self.quantize))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def ensure(self, seq: int, past: int) -> Path:
        """The program file of a step of ``seq`` tokens after ``past`` cached ones, compiled if
        the folder has none."""
        path = self.path(seq, past)
        if not path.exists():
            self._compile(seq, past, path)
            self.compiled.append((seq, past))
        return path

    def program(self, seq: int, past: int):
        from isa.asm import load
        return load(self.ensure(seq, past))

    def discard(self, seq: int, past: int) -> None:
        """Remove a program and its data file (at full model size each holds gigabytes of weights)."""
        path = self.path(seq, past)
        for f in (path, Path(str(path) + ".data")):
            f.unlink(missing_ok=True)

    def _arch_for(self, program: Path) -> str:
        """The ``.arch`` the program carries, for dlegion-run: a preset's name, or the machine
        file's path from the program's folder (where dlegion-run resolves it)."""
        if not self.arch_name.endswith(".toml"):
            return self.arch_name
        import os
        return Path(os.path.relpath(os.path.abspath(self.arch_name), program.parent.resolve())).as_posix()

    def _compile(self, seq: int, past: int, path: Path) -> None:
        from isa.asm import save
        from isa.files import Staged
        from dlegion_cc.errors import CompileError
        from dlegion_cc.pipeline import Options, compile_model
        options = Options(self.arch, self.graph.dims(seq, past), attention=self.attention, quantize=self.quantize)
        data_path = Path(str(path) + ".data")
        try:
            with Staged(data_path) as data:
                _, program = compile_model(self.graph.path, options, data_path.name, None, self.progress, data)
                save(dataclasses.replace(program, arch=self._arch_for(path)), path, data, binary=True)
        except CompileError as e:
            raise GenerateError(f"sequence {seq}, past {past}: {str(e).splitlines()[0]}") from None


def steps(prompt: int, new_tokens: int) -> list[tuple[int, int]]:
    """(sequence, past) of each program run: the prefill, then a decode step per token after the
    first (the prefill's logits give the first)."""
    return [(prompt, 0)] + [(1, prompt + i) for i in range(new_tokens - 1)]


def compile_all(build: Build, prompt: int, new_tokens: int) -> None:
    """Every program the loop will run, the longest past first: a past the model cannot take is
    refused before any work (and the others are then in the build folder)."""
    order = steps(prompt, new_tokens)
    for seq, past in [order[0]] + order[1:][::-1]:
        build.ensure(seq, past)


# --- the loop --------------------------------------------------------------------------------------

@dataclass
class Step:
    """One program run of the loop: its shape, the token it chose, and its time on the machine."""
    seq: int
    past: int
    token: int
    cycles: int
    seconds: float
    logits: np.ndarray          # the last position's


def greedy(logits: np.ndarray) -> int:
    """The next token: the largest logit of the last position (the lowest id on a tie, as argmax)."""
    return int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1]))


def step_inputs(graph: CacheGraph, ids: list[int], past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A step's inputs: the new tokens, the cache, and where the graph has them an all-ones
    attention mask and the new tokens' positions."""
    held = next(iter(past.values())).shape[PAST_AXIS]
    extra = {MASK: np.ones((1, held + len(ids))), POSITIONS: np.arange(held, held + len(ids)).reshape(1, -1)}
    return {IDS: np.asarray([ids], np.int64), **past,
            **{name: extra[name].astype(dtype) for name, dtype in graph.int_types.items()}}


def next_past(graph: CacheGraph, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The present outputs as the next step's past inputs."""
    return {graph.feeds[name]: outputs[name] for name in graph.feeds}


def check_prompt(graph: CacheGraph, prompt: list[int], new_tokens: int) -> None:
    if not prompt:
        raise GenerateError("the prompt is empty")
    if new_tokens < 1:
        raise GenerateError(f"{new_tokens} tokens to generate: at least 1")
    if graph.vocab is not None and not all(0 <= t < graph.vocab for t in prompt):
        bad = next(t for t in prompt if not 0 <= t < graph.vocab)
        raise GenerateError(f"prompt token {bad} is outside the vocabulary of {graph.path} (0 to {graph.vocab - 1})")


def emulate(build: Build, prompt: list[int], new_tokens: int, races: bool = True, on_step=None) -> list[Step]:
    """Generate ``new_tokens`` tokens after ``prompt`` on the emulator; ``on_step(inputs,
    result)`` is told of each run (--check judges it)."""
    from runtime.emulator import run
    graph, out, ids, past = build.graph, [], list(prompt), build.graph.empty_past()
    with build.progress.task("generating", new_tokens) as advance:
        for seq, p in steps(len(prompt), new_tokens):
            inputs = step_inputs(graph, ids, past)
            result = run(build.program(seq, p), build.arch, inputs, races=races, keep=False)
            if on_step is not None:
                on_step(inputs, result)
            logits = result.outputs["logits"]
            token = greedy(logits)
            cycles = int(result.timeline.cycles)
            out.append(Step(seq, p, token, cycles, cycles / (build.arch.clock_ghz * 1e9), logits[0, -1].copy()))
            ids, past = [token], next_past(graph, result.outputs)
            advance()
    return out


def onnxruntime_loop(graph: CacheGraph, prompt: list[int], new_tokens: int,
                     reference: str = "onnxruntime") -> list[int]:
    """The same greedy loop in onnxruntime, on its own presents: the tokens it generates."""
    from runtime.check import session
    sess = session(graph.path, reference)
    names = [o.name for o in sess.get_outputs()]
    tokens, ids, past = [], list(prompt), graph.empty_past()
    for _ in range(new_tokens):
        outputs = dict(zip(names, sess.run(names, step_inputs(graph, ids, past))))
        tokens.append(greedy(outputs["logits"]))
        ids, past = [tokens[-1]], next_past(graph, outputs)
    return tokens
