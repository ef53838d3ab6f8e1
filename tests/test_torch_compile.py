"""The drop-in modules under ``torch.compile``: their megakernel call is a ``torch.library``
custom op with a fake implementation, so a module using them compiles with ``fullgraph=True``
(no graph break) and gives the eager result, at several token counts. CPU: the interpreter
backend through dynamo + AOT autograd. GPU (``gpu``): ``mode="reduce-overhead"`` (CUDA-graph
capture) on the megakernel."""

import copy

import pytest
import torch

from cutemk import torch_ops
from cutemk.nn import MegaMLP, MegaMoE


def _mlp(backend, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h, i = 64, 128
    w = [torch.randn(i, h, generator=g) / 8, torch.randn(i, h, generator=g) / 8]
    w.append(torch.randn(h, i, generator=g) / 11)
    return MegaMLP(*w, max_tokens=256, backend=backend).to(device, dtype)


def _moe(backend, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    e, h, i = 8, 64, 32
    return MegaMoE(
        torch.randn(e, h, generator=g),
        torch.randn(e, 2 * i, h, generator=g) / 8,
        torch.randn(e, h, i, generator=g) / 6,
        top_k=2,
        max_tokens=256,
        backend=backend,
    ).to(device, dtype)


class _Block(torch.nn.Module):
    """A residual block around the module, so the compiled graph has torch ops on both sides."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(torch.nn.functional.gelu(x))


@pytest.mark.parametrize("make", [_mlp, _moe], ids=["mlp", "moe"])
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_fullgraph_compile_matches_eager(make, compile_backend):
    block = _Block(make("interpret"))
    compiled = torch.compile(block, fullgraph=True, backend=compile_backend, dynamic=True)
    gen = torch.Generator().manual_seed(2)
    for t in (3, 17, 64):
        x = torch.randn(2, t, 64, generator=gen)
        torch.testing.assert_close(compiled(x), block(x), rtol=0, atol=0)


def test_copies_and_layers_share_a_key_and_never_recompile():
    """Modules of one configuration run the same kernels: a deep copy (its original gone,
    in a new dtype) still runs, and twelve layers compiled one by one compile once."""
    m = _mlp("interpret")
    c = copy.deepcopy(m).to(torch.bfloat16)
    assert torch_ops.key_of(m) == torch_ops.key_of(c)
    want = c(torch.ones(3, 64, dtype=torch.bfloat16))
    del m
    twin = _mlp("interpret")  # built while c lives, then c goes: twin alone runs the key
    del c
    c = twin.to(torch.bfloat16)
    compiled = torch.compile(c, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(3, 64, dtype=torch.bfloat16)), want)
    torch._dynamo.reset()
    layers = [_moe("interpret") for _ in range(12)]
    x = torch.randn(4, 64)
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for layer in layers:
            torch.testing.assert_close(
                torch.compile(layer, fullgraph=True, backend="eager")(x), layer(x)
            )


def test_a_profiled_module_has_a_key_of_its_own():
    """A profiled module compiles other kernels: sharing a key with its unprofiled twin would
    let the op run the twin (and leave the profile empty)."""
    plain, profiled = _mlp("interpret"), _mlp("interpret")
    profiled.profile = True
    assert torch_ops.key_of(plain) != torch_ops.key_of(profiled)
    assert torch_ops.key_of(profiled) == torch_ops.key_of(profiled)
    slices = _mlp("interpret")
    slices.profile = "slices"  # kernels of their own again
    assert torch_ops.key_of(slices) not in (torch_ops.key_of(plain), torch_ops.key_of(profiled))


class _LiveBlock(torch.nn.Module):
    """A residual block whose module takes the token count as device data."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, n):
        return x + self.inner(torch.nn.functional.gelu(x), num_tokens=n)


@pytest.mark.parametrize("make", [_mlp, _moe], ids=["mlp", "moe"])
def test_live_count_compiles_once_for_every_count(make):
    """``forward(x, num_tokens=n)`` under ``torch.compile(fullgraph=True)``: the live call is
    the custom op ``cutemk::mega_live`` (shapes at the maximum, whatever the count), so one
    compiled graph serves every count; rows below the count equal the eager module's."""
    block = _LiveBlock(make("interpret"))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(block, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(5)
    for t in (1, 3, 17, 200, 256, 0):
        x = torch.randn(256, 64, generator=gen)
        n = torch.tensor([t], dtype=torch.int32)
        got = compiled(x, n)
        if t:
            want = x[:t] + block.inner(torch.nn.functional.gelu(x[:t]))
            torch.testing.assert_close(got[:t], want, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 1
    assert any("mega_live" in str(node.target) for node in graphs[0].graph.nodes)
    with pytest.raises(Exception, match="out"):
        torch.compile(
            lambda x, n, o: block.inner.forward_live(x, n, out=o), fullgraph=True, backend="eager"
        )(x, n, torch.empty_like(x))


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_mlp, _moe], ids=["mlp", "moe"])
def test_reduce_overhead_captures_the_live_count_once(make):
    """``mode="reduce-overhead"`` on a module called with ``num_tokens``: the shapes never
    change, so its CUDA graph is captured once and replays correctly at every count."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    inner = make(None, "cuda", torch.bfloat16)
    block = _LiveBlock(inner)
    import cutemk as mk

    mk.warmup(inner, live=True, progress=False)
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(6)
    n = torch.zeros(1, dtype=torch.int32, device="cuda")
    for t in (5, 5, 5, 40, 1, 256, 129):
        x = torch.randn(256, 64, device="cuda", generator=gen).bfloat16()
        n.fill_(t)
        got = compiled(x, n).float()
        want = (x[:t] + inner(torch.nn.functional.gelu(x[:t]))).float()
        torch.testing.assert_close(got[:t], want, rtol=2e-2, atol=2e-2)
    inner.check_live()


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_mlp, _moe], ids=["mlp", "moe"])
def test_reduce_overhead_captures_the_megakernel(make):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    block = _Block(make(None, "cuda", torch.bfloat16))
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for t in (5, 5, 5, 40):
        x = torch.randn(t, 64, device="cuda", generator=gen).bfloat16()
        torch.testing.assert_close(compiled(x).float(), block(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_decoder_layer_under_fullgraph_compile(compile_backend):
    """MegaDecoderLayer's custom op mutates the caches: compiled, the output and the updated
    caches equal the eager call's."""
    from cutemk.layers import DecoderConfig
    from cutemk.nn import MegaDecoderLayer
    from cutemk.ops import rope_table

    cfg = DecoderConfig(
        hidden=64,
        intermediate=96,
        heads=4,
        kv_heads=2,
        head_dim=32,
        page_size=8,
        max_pages=4,
        max_positions=64,
        attention_align=16,
    )
    g = torch.Generator().manual_seed(4)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    w = {
        "input_norm": 1 + r(64, scale=0.1),
        "w_qkv": r(256, 64, scale=0.125),
        "q_norm": 1 + r(32, scale=0.1),
        "k_norm": 1 + r(32, scale=0.1),
        "cos_sin": rope_table(64, 32),
        "w_o": r(64, 128, scale=0.09),
        "post_norm": 1 + r(64, scale=0.1),
        "w_gate_up": r(192, 64, scale=0.125),
        "w_down": r(64, 96, scale=0.1),
    }
    layer = MegaDecoderLayer(w, cfg, max_batch=4, backend="interpret")
    lens = torch.tensor([5, 20], dtype=torch.int32)
    table = torch.tensor([[0, 1, 0, 0], [2, 3, 4, 0]], dtype=torch.int32)
    x, pos = r(2, 64), lens - 1
    kc, vc = r(5, 8, 2, 32), r(5, 8, 2, 32)
    kc2, vc2 = kc.clone(), vc.clone()
    want = layer(x, pos, kc, vc, table, lens)
    compiled = torch.compile(layer, fullgraph=True, backend=compile_backend)
    got = compiled(x, pos, kc2, vc2, table, lens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(kc2, kc, rtol=0, atol=0)
    torch.testing.assert_close(vc2, vc, rtol=0, atol=0)


def test_eager_calls_skip_the_custom_op_and_traces_keep_it(monkeypatch):
    """An eager call launches without the custom op's dispatch; under a fake-tensor trace (and
    under ``torch.compile``, above) the op runs its fake implementation, so a trace sees the op
    and nothing launches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = _mlp("interpret")
    x = torch.randn(5, 64)
    assert torch_ops.direct(x)
    through_op, launches = [], []
    runner, launch = torch_ops._runner, type(m)._launch
    monkeypatch.setattr(torch_ops, "_runner", lambda key: through_op.append(key) or runner(key))
    monkeypatch.setattr(type(m), "_launch", lambda *a: launches.append(1) or launch(*a))
    eager = m(x)
    assert launches == [1] and not through_op  # launched directly
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # the weights stay real
        fx = mode.from_tensor(x)
        assert not torch_ops.direct(fx)
        out = m(fx)
    assert launches == [1] and out.shape == x.shape  # the fake implementation, no launch
    torch.testing.assert_close(eager, m(x))


@pytest.mark.parametrize("make", [_mlp, _moe], ids=["mlp", "moe"])
def test_fullgraph_compile_after_an_eager_call_at_the_same_shape(make):
    """A module called eagerly (a warm-up, say) keeps that launch for the shape; tracing the
    module at the same shape must not try to trace that host state (it used to fail with
    ``Unsupported: call to a callable object with no traceable __call__``)."""
    torch._dynamo.reset()
    m = make("interpret")
    x = torch.randn(5, m.hidden, generator=torch.Generator().manual_seed(2))
    want = m(x)
    got = torch.compile(m, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, want)


def test_the_live_op_called_directly_checks_its_arguments():
    """``torch.ops.cutemk.mega_live`` called by hand skipped ``forward_live``'s checks: x of 10
    rows for a module of 256 ran, an empty weight list was a raw IndexError."""
    from cutemk import torch_ops
    from cutemk.errors import LayoutError

    m = _mlp("interpret")
    key = torch_ops.key_of(m)
    weights = list(m._leaf_weights())
    n = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(LayoutError, match=r"takes x of shape \(256, 64\) in its weights"):
        torch.ops.cutemk.mega_live(torch.randn(10, 64), n, weights, key)
    with pytest.raises(LayoutError, match="takes its 2 weights"):
        torch.ops.cutemk.mega_live(torch.randn(256, 64), n, [], key)
    y = torch.ops.cutemk.mega_live(torch.randn(256, 64), n, weights, key)
    assert y.shape == (256, 64)


def test_the_ops_fake_implementations_check_shapes_as_the_real_calls_do():
    """A traced call of a module's op with arguments of the wrong shape failed only at its
    first real run: the fakes returned ``empty_like(x)`` for anything. Now the fake (meta)
    implementation and the real call run the module's same checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cutemk.errors import LayoutError

    for make, op in ((_mlp, torch.ops.cutemk.mega_mlp), (_moe, torch.ops.cutemk.mega_moe)):
        m = make("interpret")
        key = torch_ops.key_of(m)
        weights = list(m._leaf_weights())
        bad = [w[:-1] for w in weights]
        for mode in (FakeTensorMode(), None):  # traced, then real
            with mode if mode is not None else torch.no_grad():
                conv = mode.from_tensor if mode is not None else (lambda t: t)
                ws = [conv(w) for w in weights]
                with pytest.raises(LayoutError, match="takes its"):
                    op(conv(torch.randn(5, 64)), *[conv(w) for w in bad], key)
                with pytest.raises(LayoutError, match=r"T <= max_tokens=256"):
                    op(conv(torch.randn(300, 64)), *ws, key)
                with pytest.raises(LayoutError, match=r"\(T, 64\)"):
                    op(conv(torch.randn(5, 32)), *ws, key)
                assert op(conv(torch.randn(5, 64)), *ws, key).shape == (5, 64)
