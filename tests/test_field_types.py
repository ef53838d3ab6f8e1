"""Op and layer configs hold values of their fields' types: a switch a bool (``"no"`` is not
off), a size an int that is not a bool, a float a finite number; refused when the op is called
or the config built, naming the field, not at the first launch."""

import numpy as np
import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.layers import DecoderConfig, MoeConfig


def _graph():
    g = mk.Graph("types")
    T = mk.sym("T", max=64)
    return g, T


def test_an_op_call_refuses_a_bool_size_and_a_truthy_switch():
    g, T = _graph()
    x = g.input("x", (T, 64), torch.float32)
    w = g.weight("w", (32, 64), torch.float32)
    with pytest.raises(TypeError, match="block_m must be an int, got True"):
        g.call(ops.gemm, x, w, block_m=True)
    logits = g.input("logits", (T, 8), torch.float32)
    with pytest.raises(TypeError, match="renormalize must be a bool, got 'no'"):
        g.call(ops.topk_softmax, logits, k=2, renormalize="no")
    with pytest.raises(TypeError, match="eps must be a number"):
        g.call(ops.rmsnorm, x, eps="1e-6")
    g.call(ops.gemm, x, w, block_m=16)  # the same calls with proper values go through
    g.call(ops.topk_softmax, logits, k=2, renormalize=False)


def _attention_args(g, T):
    dt = torch.bfloat16
    q = g.input("q", (T, 32, 128), dt)
    k = g.input("k_cache", (mk.sym("P", min=1, max=1 << 16), 16, 8, 128), dt)
    v = g.input("v_cache", (k.spec.shape[0], 16, 8, 128), dt)
    pt = g.input("page_table", (T, 256), torch.int32)
    lens = g.input("seq_lens", (T,), torch.int32)
    return q, k, v, pt, lens


@pytest.mark.parametrize(
    "config, err",
    [
        ({"merge_batched": "no"}, TypeError),
        ({"merge_batched": 1}, TypeError),
        ({"scale": "0.1"}, TypeError),
        ({"scale": float("nan")}, ValueError),
        ({"scale": float("inf")}, ValueError),
    ],
)
def test_attention_refuses_a_truthy_merge_and_a_bad_scale(config, err):
    g, T = _graph()
    with pytest.raises(err, match=next(iter(config))):
        g.call(ops.attention_decode, *_attention_args(g, T), **config)


def test_attention_takes_none_and_bools_for_its_merge_and_a_number_for_its_scale():
    for config in ({"merge_batched": None}, {"merge_batched": False}, {"scale": 0.1}):
        g, T = _graph()
        g.call(ops.attention_decode, *_attention_args(g, T), **config)


@pytest.mark.parametrize(
    "field, value",
    [
        ("attention_merge_batched", "no"),
        ("moe_router_topk", "False"),
        ("fused_append", 1),
        ("block_m", True),
        ("eps", float("nan")),
    ],
)
def test_decoder_config_refuses_values_of_other_types(field, value):
    err = ValueError if field == "eps" else TypeError
    with pytest.raises(err, match=f"DecoderConfig: {field}"):
        DecoderConfig(64, 128, 4, 2, 16, **{field: value})


def test_moe_config_refuses_values_of_other_types():
    with pytest.raises(TypeError, match="MoeConfig: router_topk must be a bool"):
        MoeConfig(64, 32, 8, 2, router_topk="no")
    with pytest.raises(TypeError, match="MoeConfig: block_m must be an int"):
        MoeConfig(64, 32, 8, 2, block_m=True)
    MoeConfig(64, 32, 8, 2, down_block_n=None, route_chunk=None)  # None where allowed


def test_modules_check_their_launch_settings_when_built():
    """A module's top-k limit, scheduler, SM count and tile options are refused when it is
    built, not at its first call."""
    from cutemk.nn import MegaMoE

    w = torch.randn(64, 32), torch.randn(64, 32, 32), torch.randn(64, 32, 16)
    bad = [
        ({"top_k": 33}, "top_k must be an int in \\[1, 32\\]"),
        ({"top_k": 2, "num_sms": 0}, "num_sms"),
        ({"top_k": 2, "num_sms": True}, "num_sms"),
        ({"top_k": 2, "scheduler": None}, "scheduler"),
        ({"top_k": 2, "options": {"block_m": 1000}}, "at most 256"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            MegaMoE(*w, **kw)
    MegaMoE(*w, top_k=32, num_sms=8, scheduler="dynamic", options={"block_m": 256})


def test_warmup_takes_one_count_and_the_decoder_layer_its_configs():
    """``warmup(module, tokens=5)`` plans one count (an int or ints, not a string); a
    ``MegaDecoderLayer`` built directly takes a DecoderConfig and None or a MoeConfig."""
    import cutemk
    from cutemk.nn import MegaDecoderLayer, MegaMLP

    w = torch.randn(32, 64), torch.randn(32, 64), torch.randn(64, 32)
    mlp = MegaMLP(*w, max_tokens=8, backend="interpret")
    cutemk.warmup(mlp, tokens=5)
    with pytest.raises(TypeError, match="warmup tokens"):
        cutemk.warmup(mlp, tokens="5")
    # a numpy int or an integer tensor is a count too (refused, or 'iteration over a 0-d
    # tensor'); a float tensor's 2.5 is not (it planned 2)
    for one in (np.int64(5), torch.tensor(5), torch.tensor([3, 5])):
        cutemk.warmup(mlp, tokens=one, progress=False)
    with pytest.raises(ValueError, match="positive ints"):
        cutemk.warmup(mlp, tokens=torch.tensor([2.5]), progress=False)
    # switches are bools ("no" switched them on) and pages a positive int (2.5 was taken as 2)
    for kw in ({"progress": "no"}, {"parallel": "no"}, {"live": "yes"}):
        with pytest.raises(TypeError, match=f"warmup {next(iter(kw))} must be a bool"):
            cutemk.warmup(mlp, **kw)
    for pages in (0, 2.5, "7"):
        with pytest.raises(ValueError, match="warmup pages must be a positive int"):
            cutemk.warmup(mlp, live=True, pages=pages, progress=False)
    # pages belong to a decoder layer's live path (they were ignored anywhere else)
    for kw in ({"live": True}, {}):
        with pytest.raises(ValueError, match="page count of a MegaDecoderLayer"):
            cutemk.warmup(mlp, pages=5, progress=False, **kw)
    for cfg, moe in (({"hidden": 64}, None), (None, None)):
        with pytest.raises(TypeError, match="cfg must be a DecoderConfig"):
            MegaDecoderLayer({}, cfg, moe)
    with pytest.raises(TypeError, match="moe must be None or a MoeConfig"):
        MegaDecoderLayer({}, DecoderConfig(64, 128, 4, 2, 16), {"num_experts": 8})


def test_a_plan_refuses_bindings_outside_its_syms_bounds():
    """``CompiledGraph.plan`` / ``instantiate`` hold each sym's binding to an int within its
    [min, max], as a call does: a plan past the max would outgrow buffers sized for it."""
    import cutemk as mk
    from cutemk import ops
    from cutemk.errors import ShapeError
    from cutemk.plan import instantiate

    t = mk.sym("T", max=32)
    g = mk.Graph("g")
    x = g.input("x", (t, 64), torch.float32)
    w = g.weight("w", (64, 64), torch.float32)
    g.output(g.call(ops.gemm, x, w, block_m=16, block_n=16), "y")
    c = g.compile("interpret", num_sms=2)
    for env, msg in (
        ({"T": 33}, "exceeds its declared max 32"),
        ({"T": 0}, "below its declared min 1"),
        ({"T": -5}, "below its declared min 1"),
        ({"T": 2.5}, "must be an int"),
        ({"T": True}, "must be an int"),
        ({"T": "3"}, "must be an int"),
        ({}, "is not bound"),
    ):
        with pytest.raises(ShapeError, match=msg):
            c.plan(env)
        with pytest.raises(ShapeError, match=msg):
            instantiate(g, env)
    assert c.plan({"T": np.int64(4)}).env["T"] == 4


def test_configs_refuse_sizes_below_one():
    """``DecoderConfig`` / ``MoeConfig``: a size below 1 (or a float not above 0) is refused when
    the config is made, not at the batch size whose graph first builds an op from it."""
    from cutemk.layers import DecoderConfig, MoeConfig

    with pytest.raises(ValueError, match="DecoderConfig: block_n must be a positive int, got -1"):
        DecoderConfig(64, 128, 4, 2, 16, block_n=-1)
    with pytest.raises(ValueError, match="DecoderConfig: eps must be above 0"):
        DecoderConfig(64, 128, 4, 2, 16, eps=0.0)
    with pytest.raises(ValueError, match="MoeConfig: combine_block_m must be a positive int"):
        MoeConfig(64, 32, 8, 2, combine_block_m=0)
    DecoderConfig(64, 128, 4, 2, 16, split_k=None)  # None: the per-regime choice


def test_graph_names_and_shapes_are_checked_when_built():
    import cutemk as mk
    from cutemk import ops
    from cutemk.errors import GraphError

    g = mk.Graph("g")
    for bad in (None, 5, "", ("a",)):
        with pytest.raises(GraphError, match="must be a non-empty str"):
            g.input(bad, (4, 8), torch.float32)
    with pytest.raises(TypeError, match="shape must be a tuple"):
        g.input("x", 64, torch.float32)
    x = g.input("x", (4, 8), torch.float32)
    y = g.call(ops.rmsnorm, x, block_m=1)
    with pytest.raises(GraphError, match="must be a non-empty str"):
        g.output(y, 5)
    with pytest.raises(GraphError, match="must be a non-empty str"):
        g.call(ops.rmsnorm, x, block_m=1, name=7)


def test_module_regime_and_warmup_refuse_bad_arguments():
    import cutemk as mk
    from cutemk.nn import MegaMLP

    m = MegaMLP(
        torch.randn(32, 64),
        torch.randn(32, 64),
        torch.randn(64, 32),
        max_tokens=8,
        backend="interpret",
    )
    for bad in (-1, 0, 2.5, True):
        with pytest.raises(ValueError, match="tokens must be a positive int"):
            m.regime(bad)
    with pytest.raises(TypeError, match="got the class MegaMLP"):
        mk.warmup(MegaMLP)


def _small_gemm_graph():
    import cutemk as mk
    from cutemk import ops

    g = mk.Graph("g")
    x = g.input("x", (mk.sym("T", max=64), 16), torch.float32)
    w = g.weight("w", (32, 16), torch.float32)
    g.output(g.call(ops.gemm, x, w, block_m=16, block_n=16), "y")
    return g


def test_custom_scheduler_mistakes_are_named():
    """A scheduler class for an instance, a mode that is not a SchedulingMode, a static
    build() that returns something else, and a dynamic initial_order with ids out of range,
    twice, or waiting tasks: each a clear error, not a raw one or a wrong run."""
    from dataclasses import dataclass

    import cutemk.schedulers as S
    from cutemk.errors import ScheduleError
    from cutemk.scheduling import SchedulingMode

    g = _small_gemm_graph()
    x, w = torch.randn(64, 16), torch.randn(32, 16)
    for cls in (S.StaticScheduler, S.DynamicScheduler):
        with pytest.raises(ValueError, match="or a Scheduler instance"):
            g.compile("interpret", scheduler=cls)

    @dataclass
    class Order:
        ids: list
        mode: SchedulingMode = SchedulingMode.DYNAMIC
        name: str = "custom"

        def initial_order(self, plan):
            return self.ids

    good = list(range(8))  # 4 x 2 tiles, none waits
    torch.testing.assert_close(g.compile("interpret", scheduler=Order(good[::-1]))(x, w=w), x @ w.T)
    for ids, msg in (
        (good + [8], "outside 0..7"),
        (good[:-1] + [-1], "outside 0..7"),
        (good + [3], "twice"),
        (good[:-1], "ready tasks left out: \\[7\\]"),
        ("abc", "must be a list of task ids"),
    ):
        with pytest.raises(ScheduleError, match=msg):
            g.compile("interpret", scheduler=Order(ids))(x, w=w)
    with pytest.raises(ValueError, match="mode must be a SchedulingMode"):
        g.compile("interpret", scheduler=Order(good, mode="static"))

    @dataclass
    class ListBuilder:
        mode: SchedulingMode = SchedulingMode.STATIC
        name: str = "lists"

        def build(self, plan, num_sms):
            return [list(range(plan.num_tasks))]

    with pytest.raises(ScheduleError, match="must return a StaticSchedule, got list"):
        g.compile("interpret", scheduler=ListBuilder())(x, w=w)


def test_symbolic_widths_an_op_needs_even_are_checked_when_bound():
    """A gate/up width (the silu_mul epilogue's B rows, silu_mul's h columns) known only when
    a call binds it: an odd value is a ShapeError, not halves cut in the wrong place."""
    import cutemk as mk
    from cutemk import ops
    from cutemk.errors import ShapeError

    n = mk.sym("N", max=64)
    g = mk.Graph("g")
    x = g.input("x", (mk.sym("T", max=8), 16), torch.float32)
    w = g.weight("w", (n, 16), torch.float32)
    g.output(g.call(ops.gemm, x, w, epilogue="silu_mul", block_m=16, block_n=16), "y")
    c = g.compile("interpret")
    with pytest.raises(ShapeError, match="needs an even b.shape\\[0\\] = N, got 5"):
        c(torch.randn(3, 16), torch.randn(5, 16))
    assert c(torch.randn(3, 16), torch.randn(6, 16)).shape == (3, 3)
    g2 = mk.Graph("g2")
    h = g2.input("h", (mk.sym("T", max=8), mk.sym("W", max=64)), torch.float32)
    g2.output(g2.call(ops.silu_mul, h), "o")
    with pytest.raises(ShapeError, match="must be even, got 5"):
        g2.compile("interpret")(torch.randn(3, 5))


def test_op_builders_name_a_wrong_rank():
    import cutemk as mk
    from cutemk import ops
    from cutemk.errors import ShapeError

    g = mk.Graph("g")
    t = mk.sym("T", max=64)
    i32 = torch.int32
    with pytest.raises(ShapeError, match="gemm_split_reduce part must be 3-D"):
        g.call(ops.gemm_split_reduce, g.input("part", (t, 16), torch.float32))
    ids = g.input("ids", (t, 2), i32)
    with pytest.raises(ShapeError, match="moe_route_place chunk_base must be 2-D"):
        g.call(
            ops.moe_route_place,
            ids,
            g.input("cb", (4,), i32),
            g.input("ti", (8, 2), i32),
            num_experts=4,
            block_m=8,
        )
    with pytest.raises(ShapeError, match="moe_slot_gemm ids must be 2-D"):
        g.call(
            ops.moe_slot_gemm,
            g.input("x", (t, 16), torch.float32),
            g.input("w", (4, 32, 16), torch.float32),
            g.input("i0", (), i32),
        )


def test_a_module_runs_the_scheduler_and_sm_count_set_after_it_was_built():
    """Setting ``scheduler`` / ``num_sms`` on a built module takes effect (it used to keep the
    graphs compiled for the values it was built with), and a bad value is refused."""
    import cutemk.schedulers as S
    from cutemk.nn import MegaMLP

    w = (torch.randn(48, 32), torch.randn(48, 32), torch.randn(32, 48))
    m = MegaMLP(*w, max_tokens=64, backend="interpret", scheduler="static", num_sms=4)
    x = torch.randn(5, 32)
    want = m(x)
    m.scheduler, m.num_sms = "dynamic", 2
    torch.testing.assert_close(m(x), want)
    graph = m.compiled(m.regime(5))
    assert graph.scheduler.name == "dynamic" and graph.num_sms == 2
    with pytest.raises(ValueError, match="num_sms must be None or a positive int"):
        m.num_sms = 0
    with pytest.raises(ValueError, match="or a Scheduler instance"):
        m.scheduler = S.StaticScheduler
    assert m.compiled(m.regime(5)) is graph  # the refused values changed nothing


def test_an_op_built_outside_a_graph_checks_its_field_types_first():
    """An op instance built by its builder, its class or ``dataclasses.replace`` (to be given
    to ``g.call`` later) names the field, not a comparison inside the op's own checks."""
    import dataclasses

    from cutemk.tileop import TensorSpec, registered_ops

    x = TensorSpec((16, 64), torch.float32)
    with pytest.raises(TypeError, match="rmsnorm: eps must be a number, got '1e-6'"):
        ops.rmsnorm(x, eps="1e-6")
    op = ops.rmsnorm(x, eps=1e-6)
    with pytest.raises(TypeError, match="eps must be a number"):
        dataclasses.replace(op, eps="1e-6")
    with pytest.raises(TypeError, match="block_m must be an int, got True"):
        ops.gemm(x, TensorSpec((32, 64), torch.float32), block_m=True)
    for name, cls in registered_ops().items():  # every op class, however it is built
        checks = getattr(cls.__post_init__, "_checks_types", False) or getattr(
            cls.__init__, "_checks_types", False
        )
        assert checks, name
