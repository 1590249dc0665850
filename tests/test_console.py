"""One-line errors: the first problem, its context, and a count of the rest."""
from isa.console import summary


def test_a_list_of_problems_shows_the_first_and_counts_the_rest():
    msg = "p.s:3: mm: mode w2 not supported\np.s:9: mm: mode w2 not supported\np.s:12: vadd: out of range"
    assert summary(msg) == "p.s:3: mm: mode w2 not supported (and 2 more problems)"


def test_a_parse_error_keeps_its_line_and_caret():
    msg = "p.s:2:5: unexpected 'x'\n  vadd x\n       ^"
    assert summary(msg) == msg


def test_a_single_line_is_unchanged():
    assert summary("p.s: cannot read") == "p.s: cannot read"
