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
