"""``cutemk.warmup``: compiles every regime of a drop-in module by one launch, plans the token
counts it is given (so their first calls plan nothing), refuses counts past the max, and
plans compiled graphs' counts. CPU: the interpreter backend."""

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.errors import ShapeError
from cutemk.nn import MegaMLP, MegaMoE


def _moe():
    g = torch.Generator().manual_seed(0)
    return MegaMoE(
        torch.randn(8, 64, generator=g),
        torch.randn(8, 64, 64, generator=g) / 8,
        torch.randn(8, 64, 32, generator=g) / 6,
        top_k=2,
        max_tokens=600,
        backend="interpret",
    )


def test_module_warmup_compiles_each_regime_and_plans_counts():
    m = _moe()
    report = mk.warmup(m, tokens=[3, 40, 600], progress=False)
    assert [r for r, _ in m.regime_starts()] == ["slots", "gemv", "decode", "prefill"]
    assert len(report.steps) == 4 + 3 and report.seconds > 0
    names = [name for name, _ in report.steps]
    assert names[:4] == [
        "slots: compile + launch at T=1",
        "gemv: compile + launch at T=3",
        "decode: compile + launch at T=17",
        "prefill: compile + launch at T=513",
    ]
    for t in (3, 40, 600):  # planned: the compiled graph holds the plan already
        assert (("T", t),) in m.compiled(m.regime(t))._plans, t
    with pytest.raises(ShapeError, match="outside"):
        mk.warmup(m, tokens=[601], progress=False)


def test_mlp_and_graph_warmup():
    g = torch.Generator().manual_seed(1)
    mlp = MegaMLP(
        torch.randn(32, 16, generator=g),
        torch.randn(32, 16, generator=g),
        torch.randn(16, 32, generator=g),
        max_tokens=20,
        backend="interpret",
    )
    assert len(mk.warmup(mlp, progress=False).steps) == len(mlp.regimes()) == 3
    graph = mk.Graph("one_gemm")
    x = graph.input("x", (mk.sym("T", max=64), 16))
    graph.output(graph.call(ops.gemm, x, graph.weight("w", (16, 16))), "y")
    c = graph.compile("interpret")
    assert len(mk.warmup(c, tokens=[1, 64], progress=False).steps) == 2
    # a list: every object's steps, in order
    both = mk.warmup([mlp, c], tokens=[1, 20], progress=False).steps
    assert len(both) == len(mlp.regimes()) + 2 + 2
    assert [n for n, _ in both[-2:]] == ["plan T=1", "plan T=20"]
    with pytest.raises(ShapeError):
        mk.warmup(c, tokens=[65], progress=False)
    with pytest.raises(ShapeError, match="outside"):  # checked before any work
        mk.warmup([c, mlp], tokens=[21], progress=False)
    with pytest.raises(ValueError, match="positive ints"):  # 2.7 was planned as 2
        mk.warmup(c, tokens=[2.7], progress=False)
    # the interpreter has no live kernels to prepare: the live path reads the count on the host
    assert len(mk.warmup(mlp, live=True, progress=False).steps) == len(mlp.regimes())
    with pytest.raises(TypeError):
        mk.warmup(object())


def test_warmup_serves_every_module_of_its_key():
    """A call dispatches through the custom op to any live module of the same configuration,
    so those modules share compiled graphs and plans: warming one warms them all, whichever
    the op dispatches to."""
    g = torch.Generator().manual_seed(2)
    ws = [torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)]
    ws.append(torch.randn(16, 32, generator=g))
    a, b = (MegaMLP(*ws, max_tokens=40, backend="interpret") for _ in range(2))
    mk.warmup(a, tokens=[3, 33], progress=False)
    assert b._compiled is a._compiled
    for t in (3, 33):
        assert (("T", t),) in b.compiled(b.regime(t))._plans
    other = MegaMLP(*ws, max_tokens=41, backend="interpret")  # another key: its own graphs
    assert other._compiled is not a._compiled and not other._compiled
    profiled = MegaMLP(*ws, max_tokens=40, backend="interpret")
    profiled.profile = True  # profiling kernels are others too
    assert profiled._compiled is not a._compiled
