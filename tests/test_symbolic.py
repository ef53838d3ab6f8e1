import pytest

import cutemk as mk
from cutemk.symbolic import evaluate, upper


def test_expressions_evaluate_and_bound():
    T = mk.sym("T", max=4096)
    e = mk.cdiv(T * 2, 64) + mk.smin(8, T)
    assert e.eval({"T": 1}) == 1 + 1
    assert e.eval({"T": 300}) == 10 + 8
    assert upper(e) == 128 + 8
    assert evaluate(5, {}) == 5
    assert str(T // 2 - 1) == "((T // 2) - 1)"
    assert (T + 0) is T and (T * 1) is T


def test_bounds_with_subtraction_and_max():
    T = mk.sym("T", max=100, min=4)
    e = mk.smax(T - 10, 0)
    assert e.bounds() == (0, 90)
    assert (100 - T).bounds() == (0, 96)


def test_structural_equality_and_hash():
    T = mk.sym("T", max=10)
    assert mk.cdiv(T, 4) == mk.cdiv(T, 4)
    assert hash(T * 3) == hash(T * 3)
    assert T * 3 != T * 4


def test_sym_check_errors():
    T = mk.sym("T", max=16)
    with pytest.raises(mk.ShapeError, match="exceeds its declared max 16"):
        T.check(17, "x.shape[0]")
    with pytest.raises(mk.ShapeError, match="below its declared min"):
        T.check(0)
    with pytest.raises(mk.ShapeError, match="not bound"):
        (T + 1).eval({})
    with pytest.raises(ValueError):
        mk.sym("bad name", max=4)


def test_symbolic_value_has_no_int():
    T = mk.sym("T", max=16)
    with pytest.raises(TypeError, match="no value until a launch binds it"):
        range(T)
