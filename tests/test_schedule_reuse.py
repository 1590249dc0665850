"""Every layer of a decoder has the same matmuls: each distinct one is searched once, and the
program is the same, byte for byte, as when every matmul is searched on its own."""
import numpy as np
import pytest

from isa import arch
from isa.asm import format_program
from isa.program import pack, unpack
from dlegion_cc.lower import qplan
from dlegion_cc.lower.qmatmul import legion_major, weight_pieces
from dlegion_cc.pipeline import Options, compile_model
from models.bitnet import build_bitnet, preset, save

TINY = arch.load("dlegion-tiny")
CANDIDATES, SEARCH = qplan.candidates, qplan._search


@pytest.fixture(scope="module", params=[0.0, 0.5], ids=["dense", "sparse"])
def two_layers(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse") / "model.onnx"
    save(build_bitnet(preset("tiny", layers=2, seq=8, block_sparsity=request.param)), path, external_data=False)
    return path, request.param


def compiled(path, monkeypatch, cached: bool):
    """(program text, data bytes, the key of every search run) of compiling ``path``."""
    searched = []
    monkeypatch.setattr(qplan, "candidates", lambda a, p, s: searched.append(qplan.Alike(p)) or CANDIDATES(a, p, s))
    SEARCH.cache_clear()
    monkeypatch.setattr(qplan, "_search", SEARCH if cached else SEARCH.__wrapped__)
    _, program = compile_model(path, Options(TINY, attention="fp32"))
    return format_program(program), program.data, searched


def test_each_distinct_matmul_is_searched_once(two_layers, monkeypatch):
    path, sparsity = two_layers
    text, data, searched = compiled(path, monkeypatch, cached=True)
    again, again_data, every = compiled(path, monkeypatch, cached=False)
    assert len(set(searched)) == len(searched)
    assert set(searched) == set(every)
    assert data and (text, data) == (again, again_data)
    if sparsity:
        # Each layer's weights have zero blocks of their own: no two layers share a search.
        assert len(searched) == len(every)
    else:
        assert 2 * len(searched) <= len(every)


def test_problems_differing_only_in_their_tensors_are_alike():
    p = qplan.Problem(0, None, ((1, "w2"),), 2, 1, 64, None, None, None, 0, "w8", None, False, 3, range(8), 64, 32,
                      32, segments=(qplan.Segment(3, 16, 8), qplan.Segment(4, 16, 8, 8)))
    moved = qplan.Problem(5, None, ((6, "w2"),), 7, 1, 64, None, None, None, 0, "w8", None, False, 8, range(8), 64,
                          32, 32, segments=(qplan.Segment(8, 16, 8), qplan.Segment(9, 16, 8, 8)))
    # The two segments now name one tensor: the search could tell that apart.
    merged = qplan.Problem(5, None, ((6, "w2"),), 7, 1, 64, None, None, None, 0, "w8", None, False, 8, range(8),
                           64, 32, 32, segments=(qplan.Segment(8, 16, 8), qplan.Segment(8, 16, 8, 8)))
    assert qplan.Alike(p) == qplan.Alike(moved)
    assert qplan.Alike(p) != qplan.Alike(merged)


def test_problems_with_other_zero_blocks_are_not_alike():
    base = dict(a8=0, rscale=None, weights=((1, "w2"),), scales=None, groups=1, block=64, bias=None, corr_row=None,
                corr_weight=None, k2=0, corr_mode="w8", requant=None, exact=True, out=2, rows=range(8), K=64, N=32,
                n_pad=32)
    one, other = np.ones((8, 4), bool), np.ones((8, 4), bool)
    other[3, 1] = False
    assert qplan.Alike(qplan.Problem(**base, nonzero=(one,))) != qplan.Alike(qplan.Problem(**base, nonzero=(other,)))
    assert qplan.Alike(qplan.Problem(**base, nonzero=(one,))) == qplan.Alike(qplan.Problem(**base, nonzero=(one,)))


@pytest.mark.parametrize("dtype", ["w2", "w4", "i8"])
@pytest.mark.parametrize("given", [np.int8, np.int64])
def test_pack_matches_one_weight_at_a_time(dtype, given):
    bits = {"w2": 2, "w4": 4, "i8": 8}[dtype]
    rng = np.random.default_rng(bits)
    values = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (7, 13)).astype(given)
    per = 8 // bits
    flat = list(values.reshape(-1)) + [0] * (-values.size % per)
    slow = [sum((int(v) & ((1 << bits) - 1)) << (bits * j) for j, v in enumerate(flat[i:i + per])) & 0xFF
            for i in range(0, len(flat), per)]
    assert pack(values, dtype).view(np.uint8).tolist() == slow
    assert unpack(pack(values, dtype), dtype, values.size).tolist() == values.reshape(-1).tolist()


@pytest.mark.parametrize("segments, legions, na", [([40, 24, 7], 4, 8), ([2560, 640, 640], 8, 16), ([5], 8, 16)])
def test_layout_copies_every_column_where_a_gather_puts_it(segments, legions, na):
    lay = legion_major(segments, legions, na)
    a = np.random.default_rng(0).integers(-1, 2, (3, sum(segments))).astype(np.int8)
    gathered = np.zeros((3, lay.columns.size), np.int8)
    ok = lay.columns >= 0
    gathered[:, ok] = a[:, lay.columns[ok]]
    assert np.array_equal(lay.take(a), gathered)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
def test_int8_weights_are_one_piece_of_themselves(dtype):
    w = np.random.default_rng(1).integers(-128, 128, (6, 5)).astype(dtype)
    pieces = weight_pieces(w)
    assert len(pieces) == 1 and pieces[0].dtype == np.int8 and np.array_equal(pieces[0], w)
    wide = w.astype(np.int64) * 2
    assert np.array_equal(sum(p.astype(np.int64) for p in weight_pieces(wide)), wide)
