"""Machine descriptions no compiled program can run on are refused when they are loaded."""
import dataclasses
from importlib import resources

import pytest

from isa import arch

TINY = resources.files("isa.presets").joinpath("dlegion-tiny.toml").read_text()


def _tiny(array: int, modes: str = '["w8", "w4", "w2"]') -> str:
    return (TINY.replace('name = "dlegion-tiny"', f'name = "a{array}"').replace("array = 8\n", f"array = {array}\n")
            .replace('modes = ["w8", "w4", "w2"]', f"modes = {modes}"))


# A row of the array's weights is packed into bytes: 2 w2 weights are half a byte (and the
# programs computed wrong results), 7 w4 weights 28 bits (and the programs did not run).
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 9, 10])
def test_an_array_whose_weight_rows_are_not_whole_bytes_is_refused(n):
    with pytest.raises(arch.ArchError, match=f"a{n}.toml: array {n}: a row of {n} w[42] weights is "
                                             r"\d+ bits, not whole bytes"):
        arch.from_toml_text(_tiny(n), f"a{n}.toml")


def test_the_message_names_the_mode_whose_rows_are_not_whole_bytes():
    with pytest.raises(arch.ArchError) as e:
        arch.from_toml_text(_tiny(6), "a6.toml")
    assert str(e.value) == "a6.toml: array 6: a row of 6 w2 weights is 12 bits, not whole bytes"


@pytest.mark.parametrize("n", [4, 8, 12, 16])
def test_arrays_of_whole_byte_rows_load(n):
    assert arch.from_toml_text(_tiny(n), f"a{n}.toml").array == n


def test_only_the_modes_a_machine_has_count():
    assert arch.from_toml_text(_tiny(3, '["w8"]'), "a3.toml").array == 3
    with pytest.raises(arch.ArchError, match="a row of 3 w4 weights is 12 bits"):
        arch.from_toml_text(_tiny(3, '["w8", "w4"]'), "a3.toml")


def test_a_machine_made_in_code_is_checked_alike():
    with pytest.raises(arch.ArchError, match="a row of 2 w2 weights is 4 bits"):
        dataclasses.replace(arch.load("dlegion-tiny"), array=2)


def test_pass_overlap_without_double_buffered_weights_is_refused():
    # The next window loads during a pass; single-buffered registers cannot hold both.
    text = (TINY.replace("double_buffered_weights = true", "double_buffered_weights = false")
            .replace("pass_overlap = false", "pass_overlap = true"))
    with pytest.raises(arch.ArchError, match=r"^p\.toml: pass_overlap needs double_buffered_weights"):
        arch.from_toml_text(text, "p.toml")


def test_a_psum_port_of_no_words_is_refused():
    with pytest.raises(arch.ArchError, match="acc_port_words must be a positive integer, not 0"):
        arch.from_toml_text(TINY.replace("acc_port_words = 128", "acc_port_words = 0"), "p.toml")
