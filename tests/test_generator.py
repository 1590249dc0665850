"""The model generator's streaming writer: the same model as the in-memory build, valid for onnx and
onnxruntime, written all or nothing, with progress on a terminal."""
from __future__ import annotations

import io
import sys
from contextlib import contextmanager

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper
from rich.console import Console

from isa.progress import Progress
from models import bitnet, graph, weights

# Tensors past 1 MiB, so the writer aligns some of them and pads between.
SMALL = bitnet.preset("tiny", hidden=256, ffn=1152, layers=2, vocab=1100, seq=8)


def split(model: onnx.ModelProto) -> tuple[bytes, dict]:
    """The graph without its initializers, and every initializer's value by name."""
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    rest = onnx.ModelProto()
    rest.CopyFrom(model)
    del rest.graph.initializer[:]
    return rest.SerializeToString(), values


def external_entries(path) -> list[tuple[str, int, int]]:
    model = onnx.load(path, load_external_data=False)
    return [(t.name, int(t.external_data[1].value), int(t.external_data[2].value))
            for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def terminal() -> tuple[Progress, io.StringIO]:
    out = io.StringIO()
    return Progress(True, console=Console(file=out, force_terminal=True, width=120)), out


def test_streamed_model_equals_the_in_memory_build(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "ROW_BLOCK_BYTES", 4096)  # many row blocks for the embedding and head
    bitnet.write_bitnet(SMALL, tmp_path / "m.onnx", external_data=True)
    stub = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    assert stub.ByteSize() < 100_000
    streamed_graph, streamed = split(onnx.load(tmp_path / "m.onnx"))
    monkeypatch.undo()
    built_graph, built = split(bitnet.build_bitnet(SMALL))
    assert streamed_graph == built_graph
    assert list(streamed) == list(built)
    for name, value in built.items():
        np.testing.assert_array_equal(streamed[name], value, err_msg=name)


def test_large_tensors_are_aligned_and_none_overlap(tmp_path):
    bitnet.write_bitnet(SMALL, tmp_path / "m.onnx", external_data=True)
    entries = external_entries(tmp_path / "m.onnx")
    assert any(length > graph.ALIGN_THRESHOLD for _, _, length in entries)
    assert all(offset % graph.ALIGNMENT == 0 for _, offset, length in entries if length > graph.ALIGN_THRESHOLD)
    ends = [offset + length for _, offset, length in entries]
    assert all(offset >= end for (_, offset, _), end in zip(entries[1:], ends))
    assert (tmp_path / "m.onnx.data").stat().st_size == ends[-1]


def test_save_writes_what_the_streaming_writer_writes(tmp_path):
    bitnet.write_bitnet(SMALL, tmp_path / "a.onnx", external_data=True)
    bitnet.save(bitnet.build_bitnet(SMALL), tmp_path / "b.onnx", external_data=True)
    assert (tmp_path / "a.onnx.data").read_bytes() == (tmp_path / "b.onnx.data").read_bytes()
    a = (tmp_path / "a.onnx").read_bytes()
    assert a == (tmp_path / "b.onnx").read_bytes().replace(b"b.onnx.data", b"a.onnx.data")


def test_row_blocks_draw_what_one_call_draws(monkeypatch):
    monkeypatch.setattr(weights, "ROW_BLOCK_BYTES", 3 * 4 * 37)  # 3 rows a block, the last one short
    blocks = weights.gaussian_rows(np.random.default_rng(7), (20, 37), 0.5)
    whole = weights.gaussian(np.random.default_rng(7), (20, 37), 0.5)
    np.testing.assert_array_equal(np.concatenate(list(blocks.blocks)), whole)


def test_streamed_model_passes_the_checker_and_runs_in_onnxruntime(tmp_path):
    import onnxruntime as ort
    config = bitnet.preset("2b4t", hidden=256, heads=4, kv_heads=1, ffn=512, layers=2, vocab=1000, seq=8)
    path = tmp_path / "m.onnx"
    bitnet.write_bitnet(config, path, external_data=True)
    onnx.checker.check_model(str(path))
    ids = np.random.default_rng(0).integers(0, config.vocab, (1, config.seq), dtype=np.int64)
    (streamed,) = ort.InferenceSession(str(path)).run(None, {"input_ids": ids})
    in_memory = bitnet.build_bitnet(config).SerializeToString()
    (expected,) = ort.InferenceSession(in_memory).run(None, {"input_ids": ids})
    np.testing.assert_array_equal(streamed, expected)


def test_a_failed_write_leaves_the_old_files(tmp_path):
    class Breaks(Progress):
        @contextmanager
        def task(self, description, total):
            def advance(steps=1):
                raise KeyboardInterrupt

            yield advance

    (tmp_path / "m.onnx").write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        bitnet.write_bitnet(SMALL, tmp_path / "m.onnx", external_data=True, progress=Breaks(False))
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]
    assert (tmp_path / "m.onnx").read_bytes() == b"old"


def test_progress_shows_on_a_terminal(tmp_path):
    progress, out = terminal()
    bitnet.write_bitnet(SMALL, tmp_path / "m.onnx", external_data=True, progress=progress)
    assert "writing weights" in out.getvalue() and f"/{SMALL.layers + 2}" in out.getvalue()


def test_progress_steps_once_for_the_embedding_each_layer_and_the_head(tmp_path):
    class Counts(Progress):
        @contextmanager
        def task(self, description, total):
            self.total, self.done = total, 0

            def advance(steps=1):
                self.done += steps

            yield advance

    progress = Counts(False)
    bitnet.write_bitnet(SMALL, tmp_path / "m.onnx", external_data=True, progress=progress)
    assert progress.done == progress.total == SMALL.layers + 2


@pytest.mark.parametrize("quiet", [False, True])
def test_cli_shows_progress_on_a_terminal_unless_quiet(tmp_path, monkeypatch, quiet):
    progress, out = terminal()
    pretend = classmethod(lambda cls, q=False: Progress(False) if q else progress)  # as on a terminal
    monkeypatch.setattr(bitnet.Progress, "for_terminal", pretend)
    args = ["--layers", "1", "--external-data", str(tmp_path / "m.onnx")] + (["-q"] if quiet else [])
    result = CliRunner().invoke(bitnet.main, args)
    assert result.exit_code == 0, result.output
    assert ("writing weights" in out.getvalue()) != quiet


def test_a_model_past_2_gib_without_external_data_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bitnet, "MODEL_LIMIT", 100_000)  # stands for 2 GiB: the tiny model is 400 kB
    monkeypatch.setattr(sys, "argv", ["models.bitnet", str(tmp_path / "m.onnx")])
    with pytest.raises(SystemExit) as exit:
        bitnet.cli()
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "m.onnx: the model exceeds 2 GiB" in err
    assert not list(tmp_path.iterdir())
