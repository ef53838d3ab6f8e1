"""Graph building, validation and argument checks (every backend binds through the same code)."""

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.layers import mlp_graph


def _mlp(max_t=64):
    T = mk.sym("T", max=max_t)
    return mlp_graph(T, hidden=32, intermediate=24, block_m=8, block_n=16)


def _mlp_args(t, h=32, i=24):
    return (torch.randn(t, h), torch.randn(2 * i, h), torch.randn(h, i))


def test_graph_structure_and_repr():
    g = _mlp()
    assert [n.op.name for n in g.nodes] == ["gemm", "silu_mul", "gemm"]
    assert [v.name for v in g.leaves] == ["x", "w_gate_up", "w_down"]
    assert "qwen3_mlp" in repr(g) and "outputs: y" in repr(g)


def test_unbindable_sym_is_rejected():
    T, U = mk.sym("T", max=8), mk.sym("U", max=8)
    g = mk.Graph()
    x = g.input("x", (T, 4))
    w = g.weight("w", (U * 2, 4))
    g.output(g.call(ops.gemm, x, w))
    with pytest.raises(mk.GraphError, match="sym U"):
        g.compile("interpret")


def test_op_config_errors_name_the_argument():
    T = mk.sym("T", max=8)
    g = mk.Graph()
    x = g.input("x", (T, 4))
    w = g.weight("w", (6, 5))
    with pytest.raises(mk.ShapeError, match="a.shape\\[1\\]"):
        g.call(ops.gemm, x, w)
    wi = g.weight("wi", (6, 4), torch.int32)
    with pytest.raises(TypeError, match="gemm b"):
        g.call(ops.gemm, x, wi)
    with pytest.raises(ValueError, match="epilogue"):
        g.call(ops.gemm, x, g.weight("w2", (6, 4)), epilogue="gelu")


def test_duplicate_names_and_foreign_values():
    g, g2 = mk.Graph("a"), mk.Graph("b")
    T = mk.sym("T", max=8)
    x = g.input("x", (T, 4))
    with pytest.raises(mk.GraphError, match="used twice"):
        g.input("x", (T, 4))
    w2 = g2.weight("w", (4, 4))
    with pytest.raises(mk.GraphError, match="not a value of graph"):
        g.call(ops.gemm, x, w2)
    with pytest.raises(mk.GraphError, match="no outputs"):
        g.compile("interpret")


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_bad_inputs_raise_clear_errors(scheduler):
    c = _mlp(max_t=64).compile("interpret", num_sms=2, scheduler=scheduler)
    x, wgu, wd = _mlp_args(5)
    with pytest.raises(mk.ShapeError, match="x must have shape"):
        c(torch.randn(5, 33), wgu, wd)
    with pytest.raises(mk.ShapeError, match="w_down"):
        c(x, wgu, torch.randn(32, 25))
    with pytest.raises(mk.ShapeError, match="exceeds its declared max 64"):
        c(torch.randn(65, 32), wgu, wd)
    with pytest.raises(TypeError, match="x must have dtype torch.float32"):
        c(x.double(), wgu, wd)
    with pytest.raises(ValueError, match="w_gate_up must be contiguous"):
        c(x, torch.randn(32, 48).T, wd)
    with pytest.raises(mk.DeviceError, match="w_down is on meta"):
        c(x, wgu, torch.empty(32, 24, device="meta"))
    with pytest.raises(TypeError, match="missing arguments \\['w_down'\\]"):
        c(x, wgu)
    with pytest.raises(TypeError, match="unexpected argument 'bias'"):
        c(x, wgu, wd, bias=x)
    with pytest.raises(mk.ShapeError, match="must be 2-D"):
        c(x.reshape(-1), wgu, wd)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        c(x.numpy(), wgu, wd)
    with pytest.raises(ValueError, match="scheduler must be one of"):
        _mlp().compile("interpret", scheduler="random")
