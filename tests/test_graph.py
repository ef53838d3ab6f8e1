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
    with pytest.raises(TypeError, match="seed must be an int"):
        _mlp().compile("interpret", seed="x")


def test_small_builders_refuse_bad_values():
    """Values a builder would have taken and failed on later (or silently used)."""
    with pytest.raises(TypeError, match="sym name must be a str"):
        mk.sym(3, max=4)
    g = mk.Graph()
    with pytest.raises(mk.GraphError, match="output None"):
        g.output(None)
    a, b = g.input("a", (mk.sym("T", max=8), 4)), g.input("b", (mk.sym("T", max=16), 4))
    with pytest.raises(mk.ShapeError, match="two different syms named T"):
        g.call(ops.add, a, b)
    y = g.call(ops.add, a, a)
    with pytest.raises(TypeError, match="count must be"):
        g.event((1,), count="x", notify=[(y, lambda t: [(0,)])], wait=[(y, lambda t: [(0,)])])
    with pytest.raises(TypeError, match="out_dtype"):
        ops.gemm(a.spec, mk.TensorSpec((4, 4), torch.float32), out_dtype=torch.int32)
    with pytest.raises(ValueError, match="even"):
        ops.rope_table(8, 5)
    with pytest.raises(ValueError, match="theta"):
        ops.rope_table(8, 4, 0.0)


def test_auto_names_skip_taken_ones():
    T = mk.sym("T", max=8)
    g = mk.Graph()
    x = g.input("x", (T, 4))
    w = g.weight("w", (4, 4))
    a = g.call(ops.gemm, x, w, name="gemm1")
    b = g.call(ops.gemm, a, w)
    assert [n.name for n in g.nodes] == ["gemm1", "gemm0"] and b.producer.name == "gemm0"


def test_value_names_are_claimed_like_node_names():
    """An op's outputs are named ``<node>.<output>``: a leaf of that name would share its
    storage slot with the output (the launch read NaN before), so auto names skip it and an
    explicit node name that would make it is refused."""
    g = mk.Graph()
    a, b = g.input("add0.out", (4, 4)), g.input("b", (4, 4))
    y = g.call(ops.add, a, b)
    assert y.name == "add1.out"
    g.output(y)
    out = g.compile("interpret", num_sms=2)(torch.ones(4, 4), torch.ones(4, 4))
    assert torch.equal(out, torch.full((4, 4), 2.0))
    g = mk.Graph()
    a = g.input("n.out", (4, 4))
    with pytest.raises(mk.GraphError, match="'n.out' is used twice"):
        g.call(ops.add, a, a, name="n")


def test_a_built_op_must_match_its_arguments():
    """An op instance given to ``Graph.call`` was built for specs: values of other shapes or
    dtypes are refused (its output would have been the built shape, silently)."""
    g = mk.Graph()
    a, c = g.input("a", (8, 4)), g.input("c", (16, 4))
    op = ops.add(a.spec, a.spec)
    with pytest.raises(mk.GraphError, match="built with a of shape \\(8, 4\\)"):
        g.call(op, c, c)
    with pytest.raises(mk.GraphError, match="bfloat16"):
        g.call(op, a, g.input("d", (8, 4), torch.bfloat16))
    assert g.call(op, a, a).spec.shape == (8, 4)


def test_a_compiled_graph_is_final():
    """A compiled graph reads its Graph at every launch: adding to it afterwards is refused
    (an added output made the compiled graph raise a raw KeyError, an added input made it ask
    for that input)."""
    g = mk.Graph()
    a = g.input("a", (4, 4))
    y = g.call(ops.add, a, a)
    g.output(y)
    c = g.compile("interpret", num_sms=2)
    for build in (
        lambda: g.input("b", (4, 4)),
        lambda: g.weight("w", (4, 4)),
        lambda: g.call(ops.add, y, a),
        lambda: g.event((1,), notify=[(y, lambda t: [(0,)])], wait=[(y, lambda t: [(0,)])]),
    ):
        with pytest.raises(mk.GraphError, match="has been compiled"):
            build()
    assert torch.equal(c(torch.ones(4, 4)), torch.full((4, 4), 2.0))
    g.compile("interpret", num_sms=3)  # compiling again is fine


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_a_cycle_through_an_explicit_event_is_refused_for_every_scheduler(scheduler):
    """Automatic events follow the node order; an explicit one may point back and close a
    cycle. The plan refuses it for both schedulers (a dynamic launch would never push the
    tasks on it: a hang on the GPU, a DeadlockError at run time on the interpreter)."""
    g = mk.Graph()
    a, b = g.input("a", (4, 4)), g.input("b", (4, 4))
    h = g.call(ops.add, a, b)
    z = g.call(ops.add, h, b)
    g.output(z)
    g.event((1,), notify=[(z, lambda t: [(0,)])], wait=[(h, lambda t: [(0,)])])
    c = g.compile("interpret", num_sms=2, scheduler=scheduler)
    with pytest.raises(mk.GraphError, match="dependency cycle through add0\\[0\\], add1"):
        c(torch.ones(4, 4), torch.ones(4, 4))


def test_grouped_ops_need_the_routes_block_m():
    from cutemk.layers import MoeConfig

    cfg = MoeConfig(16, 8, 4, 2, block_m=16)
    T = mk.sym("T", max=64)
    g = mk.Graph()
    x = g.input("x", (T, 16))
    logits = g.call(ops.gemm, x, g.weight("wr", (4, 16)))
    _, ids = g.call(ops.topk_softmax, logits, k=2)
    tile_info, row_token, _, _ = g.call(ops.moe_route, ids, num_experts=4, block_m=cfg.block_m)
    wgu = g.weight("wgu", (4, 16, 16))
    with pytest.raises(mk.ShapeError, match="block_m must be moe_route's"):
        g.call(ops.moe_grouped_gemm, x, wgu, tile_info, row_token, block_m=8)
    h = g.call(ops.moe_grouped_gemm, x, wgu, tile_info, row_token, block_m=16)
    with pytest.raises(mk.ShapeError, match="block_m must be moe_route's"):
        g.call(ops.silu_mul, h, tile_info, block_m=8)


def test_region_declarations_are_checked():
    from dataclasses import dataclass

    from cutemk.plan import instantiate

    @dataclass(frozen=True)
    class Forgetful(ops.SiluMulTile):  # forgets to declare what it reads
        def reads(self, coord, env, data=None):
            return {}

    @dataclass(frozen=True)
    class WrongRank(ops.SiluMulTile):
        def reads(self, coord, env, data=None):
            return {"h": ((0, 1),)}

    T = mk.sym("T", max=8)
    for bad, msg in ((Forgetful, "declares nothing for 'h'"), (WrongRank, "h is 2-D")):
        g = mk.Graph()
        x = g.input("x", (T, 4))
        h = g.call(ops.gemm, x, g.weight("w", (8, 4)))
        g.output(g.call(bad(h.spec), h))
        with pytest.raises(mk.GraphError, match=msg):
            instantiate(g, {"T": 3})


def test_bad_sizes_are_refused_when_the_graph_is_built():
    from cutemk.layers import MoeConfig, mlp_graph, moe_graph

    with pytest.raises(TypeError, match="max must be an int"):
        mk.sym("T", max=2.5)
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        mlp_graph(mk.sym("T", 8), hidden=-64, intermediate=128)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        moe_graph(mk.sym("T", 8), MoeConfig(64, 32, num_experts=0, top_k=2))
    with pytest.raises(ValueError, match="top_k=4 exceeds num_experts=2"):
        moe_graph(mk.sym("T", 8), MoeConfig(64, 32, num_experts=2, top_k=4))
    g = mk.Graph("neg")
    with pytest.raises(mk.ShapeError, match=r"x.shape\[1\] must not be negative"):
        g.input("x", (mk.sym("T", 8), -5))
    with pytest.raises(mk.ShapeError, match="must not be negative"):
        g.input("y", (mk.sym("T", 8) - 9, 4))
    with pytest.raises(TypeError, match="must be an int or a sym"):
        g.input("z", (2.5, 4))


def test_size_one_dims_and_autograd_inputs_are_bound_as_device_code_sees_them():
    """A (1, K) view with strides (1, 1) is contiguous to torch but not row-major: it is
    re-viewed with row-major strides; tensors that require grad run as inference."""
    from cutemk.binding import bind

    g = mk.Graph("bind")
    x = g.input("x", (mk.sym("T", 8), 16))
    w = g.weight("w", (4, 16))
    g.output(g.call(ops.gemm, x, w, block_m=16, block_n=16), "y")
    a = torch.randn(16, 1).T
    assert a.stride() == (1, 1) and a.is_contiguous()
    wt = torch.randn(4, 16, requires_grad=True)
    _, t = bind(g, [a, wt], {})
    assert t["x"].stride() == (16, 1) and torch.equal(t["x"], a)
    assert not t["w"].requires_grad
    y = g.compile("interpret")(a, wt)
    assert torch.allclose(y, a @ wt.detach().T, atol=1e-5) and not y.requires_grad


def test_scratch_at_the_maxima_is_reported():
    from cutemk.runtime import scratch_bytes

    t = mk.sym("T", max=2**31)
    g = mlp_graph(t, 4096, 12288, torch.bfloat16)
    # gate_up output (T, 2I) and silu_mul output (T, I), bf16, at T = 2^31
    assert scratch_bytes(g) == 2**31 * (2 * 12288 + 12288) * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scratch_that_cannot_fit_is_refused_with_its_size():
    g = mlp_graph(mk.sym("T", max=2**31), 4096, 12288, torch.bfloat16, 64, 64)
    c = g.compile("cute")
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    wgu = torch.randn(2 * 12288, 4096, device="cuda").bfloat16()
    wd = torch.randn(4096, 12288, device="cuda").bfloat16()
    with pytest.raises(mk.CuteMKError, match=r"need 147456\.00 GiB .*T <= 2147483648"):
        c(x, wgu, wd)


def test_a_dim_that_is_never_negative_is_accepted():
    g = mk.Graph("halves")
    t = mk.sym("T", 256)
    g.input("x", (t - t // 2, 8))  # interval bounds say (-127, 256); it is never negative


def test_moe_expert_counts_must_agree_at_build():
    """The router's width, moe_route's experts and the expert weights' E are checked when the
    graph is built, naming the ops (they would otherwise only disagree in the data)."""
    from cutemk import ops

    t = mk.sym("T", max=64)
    for route_e, weight_e, match in ((16, 8, "top-k over 8"), (8, 16, "weights of 16 experts")):
        g = mk.Graph("moe_mismatch")
        x = g.input("x", (t, 32))
        logits = g.call(ops.gemm, x, g.weight("w_router", (8, 32)), block_m=16, block_n=8)
        _, ids = g.call(ops.topk_softmax, logits, k=2)
        tile_info, row_token, _, _ = g.call(ops.moe_route, ids, num_experts=route_e, block_m=16)
        xp = g.call(ops.moe_permute, x, tile_info, row_token, block_m=16)
        w = g.weight("w", (weight_e, 24, 32))
        y = g.call(ops.moe_grouped_gemm, xp, w, tile_info, block_m=16, block_n=8)
        g.output(y, "y")
        with pytest.raises(mk.GraphError, match=match):
            g.compile("interpret")


def _add_graph(op_cls, name="bad"):
    """A graph calling an ``ops.AddTile`` variant on two (T, 8) inputs."""
    T = mk.sym("T", max=16)
    g = mk.Graph(name)
    a, b = g.input("a", (T, 8)), g.input("b", (T, 8))
    return g, g.call(op_cls(a.spec, b.spec), a, b)


def test_a_custom_ops_declarations_are_checked_when_it_is_called():
    """Slips in a user's TileOp class are GraphErrors naming the op at ``g.call``, not a
    KeyError / AttributeError there or a torch error (or a wrong tensor) at the first launch."""
    from dataclasses import dataclass
    from typing import ClassVar

    from cutemk.tileop import TensorSpec, TileOp

    T = mk.sym("T", max=16)

    def spec_of(**kw):
        @dataclass(frozen=True)
        class Variant(ops.AddTile):
            def output_specs(self):
                return {"out": TensorSpec(**{"shape": self.a.shape, "dtype": self.a.dtype, **kw})}

        return Variant

    @dataclass(frozen=True)
    class Named(ops.AddTile):
        outputs: ClassVar[tuple[str, ...]] = ("a",)  # an output named like an input

        def output_specs(self):
            return {"a": TensorSpec(self.a.shape, self.a.dtype)}

    @dataclass(frozen=True)
    class Extra(ops.AddTile):
        def output_specs(self):
            return {"out": TensorSpec(self.a.shape, self.a.dtype), "lse": self.a}

    @dataclass(frozen=True)
    class Tupled(ops.AddTile):
        def output_specs(self):
            return {"out": (self.a.shape, self.a.dtype)}

    @dataclass(frozen=True)
    class StrOutputs(ops.AddTile):
        outputs: ClassVar[tuple[str, ...]] = "out"

    @dataclass(frozen=True)
    class Updates(ops.AddTile):
        updates: ClassVar[dict[str, str]] = {"o": "a"}

    class Plain(TileOp):  # no @dataclass
        name, inputs, outputs = "plain", ("a",), ("out",)

        def __init__(self, a):
            self.a = a

        def output_specs(self):
            return {"out": self.a}

    cases = [
        (spec_of(dtype="float32"), r"output_specs\(\)\['out'\]: dtype must be a torch.dtype"),
        (spec_of(shape=(T, 8.0)), r"shape\[1\] must be an int or a sym, got 8.0"),
        (spec_of(shape=(T - 20, 8)), r"shape\[0\] = \(T - 20\) can be negative"),
        (Named, r"\['a'\] named both an input and an output"),
        (Extra, r"one TensorSpec for each of its outputs \('out',\), got \['lse', 'out'\]"),
        (Tupled, r"output_specs\(\)\['out'\] must be a TensorSpec"),
        (StrOutputs, "outputs must be a tuple of names, got 'out'"),
        (Updates, r"updates names \['o'\], not among its outputs"),
    ]
    for cls, msg in cases:
        with pytest.raises(mk.GraphError, match=msg):
            _add_graph(cls)
    g = mk.Graph("plain")
    a = g.input("a", (T, 8))
    with pytest.raises(mk.GraphError, match="plain: a TileOp must be a dataclass"):
        g.call(Plain(a.spec), a)
    with pytest.raises(mk.GraphError, match="op must be an op builder .* got 'add'"):
        g.call("add", a, a)


def test_two_syms_of_one_name_are_told_apart_in_the_error():
    g = mk.Graph("two")
    g.output(g.call(ops.silu_mul, g.input("a", (mk.sym("T", max=8), 8))))
    g.output(g.call(ops.silu_mul, g.input("b", (mk.sym("T", max=16), 8))))
    with pytest.raises(mk.GraphError, match="named T: Sym.*max=8.* and Sym.*max=16"):
        g.compile("interpret")
