"""cutemk.nn.MegaMoE as a drop-in for transformers' Qwen3MoeSparseMoeBlock.

CPU: the interpreter backend against the HF module (fp32, transformers 5.x layout), both
``norm_topk_prob`` settings, both regimes. GPU: the megakernel (bf16) against the HF module
and against an fp32 reference that routes on the same bf16 logits, at T = 1, 5, 64, 300 and
1000 (the prefill regime), both schedulers.
"""

import pytest
import torch

from cutemk.layers import moe_reference
from cutemk.nn import MOE_DECODE_MAX_TOKENS, MegaMoE

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm  # noqa: E402


def hf_block(hidden, inter, experts, top_k, norm, dtype, device="cpu"):
    cfg = qm.Qwen3MoeConfig(
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm,
    )
    block = qm.Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return block.to(device, dtype).eval()


def hf_forward(block, x):
    with torch.no_grad():
        out = block(x.view(1, *x.shape))
    return (out[0] if isinstance(out, tuple) else out).view(x.shape)


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in the output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("norm", [True, False])
def test_matches_hf_block_on_the_interpreter(norm):
    block = hf_block(64, 32, 8, 2, norm, torch.float32)
    mega = MegaMoE.from_hf(block, max_tokens=MOE_DECODE_MAX_TOKENS + 100)
    assert mega.top_k == 2 and mega.norm_topk_prob is norm
    for t in (1, 7, 64, MOE_DECODE_MAX_TOKENS + 37):  # the last one runs the prefill graph
        x = torch.randn(t, 64)
        assert rel_err(mega(x), hf_forward(block, x)) < 1e-5, f"T={t}"
    with pytest.raises(Exception, match="max_tokens"):
        mega(torch.randn(MOE_DECODE_MAX_TOKENS + 101, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_matches_hf_block_on_the_gpu(scheduler):
    block = hf_block(2048, 768, 128, 8, True, torch.bfloat16, "cuda")
    mega = MegaMoE.from_hf(block, max_tokens=1024, scheduler=scheduler)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for t in (1, 5, 64, 300, 1000):
        x = torch.randn(t, 2048, device="cuda", generator=gen).bfloat16()
        y = mega(x)
        ref = moe_reference(
            x, mega.w_router, mega.w_gate_up, mega.w_down, 8, True, router_dtype=torch.bfloat16
        )
        assert rel_err(y, ref) < 1e-2, f"T={t} vs fp32 reference"
        assert rel_err(y, hf_forward(block, x)) < 2e-2, f"T={t} vs the HF module"
        assert torch.equal(mega(x), y), f"T={t}: the eager fast path's launch differs"


def garbage_rows(x, n):
    """Rows of ``x`` at and past ``n`` filled with what a buffer may hold: NaN, inf, huge and
    ordinary values (a live launch routes them too)."""
    fill = (float("nan"), float("inf"), float("-inf"), 1e30, -3e4)
    for k in range(n, x.shape[0]):
        if k % 6 < len(fill):
            x[k, k % x.shape[1]] = fill[k % 6]
        else:
            x[k] *= 1e3
    return x


def test_forward_live_on_the_interpreter_routes_the_rows_past_the_count():
    """The live count's CPU reference runs the plan the device picks (the smallest planned
    count at or above the live one): x's rows past the count hold NaN, inf and huge values,
    its tokens there are absent (routed nowhere), and no live token's output changes."""
    block = hf_block(64, 32, 8, 2, True, torch.float32)
    max_tokens = 40
    mega = MegaMoE.from_hf(block, max_tokens=max_tokens, backend="interpret")
    gen = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 9, 16, 17, 33, 40, 0):
        x = garbage_rows(torch.randn(max_tokens, 64, generator=gen), n)
        out = torch.full_like(x, float("nan"))
        y = mega(x, num_tokens=torch.tensor([n], dtype=torch.int32))
        y2 = mega.forward_live(x, torch.tensor([n], dtype=torch.int32), out=out)
        plan = mega.live_plan_count(n) if n else 0
        assert n <= plan <= max_tokens and torch.isnan(out[plan:]).all()
        assert y2 is out
        if n:
            assert rel_err(y[:n], hf_forward(block, x[:n])) < 1e-5, f"n={n}"
            assert torch.equal(y2[:n], y[:n])
    for bad in (0, 41, 2.0):
        with pytest.raises(ValueError, match=r"\[1, 40\]"):
            mega.live_plan_count(bad)
    with pytest.raises(Exception, match="max_tokens=40"):
        mega(x[:39], num_tokens=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(Exception, match="outside"):
        mega(x, num_tokens=torch.tensor([41], dtype=torch.int32))


def test_eager_fast_path_serves_the_block_too():
    """MegaMoE shares MegaMLP's eager fast path: the second call with rows of one shape runs
    the remembered launch (no checks, no regime lookup); replaced weights take the full path."""
    block = hf_block(64, 32, 8, 2, True, torch.float32)
    mega = MegaMoE.from_hf(block, max_tokens=40, backend="interpret")
    x = torch.randn(5, 64)
    assert rel_err(mega(x), hf_forward(block, x)) < 1e-5
    run, *rest = mega._fast[x.shape]
    calls = []
    mega._fast[x.shape] = (lambda a: calls.append(a) or run(a), *rest)
    x2 = torch.randn(5, 64)
    assert rel_err(mega(x2), hf_forward(block, x2)) < 1e-5
    assert len(calls) == 1 and calls[0][0] is x2 and len(calls[0]) == 4  # rows + 3 weights
    mega.w_router = mega.w_router.clone()  # a new weight tensor: the remembered launch is stale
    mega(x2)
    assert len(calls) == 1
    mega(x2.reshape(5, 1, 64))  # not (tokens, H) rows: the full path
    assert len(calls) == 1


def test_the_slots_router_runs_the_topk_and_options_switch_it():
    """The cute 'slots' regime's router (split along K, 128 experts, bf16, at most two tokens)
    runs the top-k in its last tile by default (``MOE_TILES``); ``options={"router_topk":
    False}`` keeps the top-k phase there and ``True`` cannot add it where it does not apply
    (more tokens); a given option is part of the key (its module compiles graphs of its own);
    unknown or non-bool options are refused."""
    from cutemk.regimes import moe_regime_graph

    def has_topk_phase(regime, **options):
        g = moe_regime_graph(
            2048, 768, 128, 8, True, regime, torch.bfloat16, 512, options=options or None
        )
        return "topk_softmax" in {n.op.name for n in g.nodes}

    for regime in ("slots", "gemv", "decode"):
        # only the slots regime's one or two tokens (layers.ROUTER_TOPK_MAX_ROWS)
        assert has_topk_phase(regime) == (regime != "slots"), regime
        assert has_topk_phase(regime, router_topk=True) == (regime != "slots"), regime
        assert has_topk_phase(regime, router_topk=False), regime
    block = hf_block(64, 32, 8, 2, True, torch.float32)
    keys = {
        MegaMoE.from_hf(block, options=o)._cutemk_key
        for o in (None, {"router_topk": True}, {"router_topk": False})
    }
    assert len(keys) == 3
    with pytest.raises(ValueError, match="unknown"):
        MegaMoE.from_hf(block, options={"router_top_k": True})
    with pytest.raises(TypeError, match="bool"):
        MegaMoE.from_hf(block, options={"router_topk": 1})


def test_options_set_tile_sizes_in_every_regime():
    """A size among the options (``block_m``: the grouped GEMMs' rows a tile) overrides every
    regime's tiles, is part of the key, and is checked: a positive int (None where the field
    takes it), not a bool or a string."""
    from cutemk.regimes import moe_regime_graph

    g = moe_regime_graph(
        2048, 768, 128, 8, True, "prefill", torch.bfloat16, 4096, options={"block_m": 64}
    )
    ops = {n.name: n.op for n in g.nodes}
    assert ops["experts_gate_up"].block_m == ops["experts_down"].block_m == 64
    plain = moe_regime_graph(2048, 768, 128, 8, True, "prefill", torch.bfloat16, 4096)
    assert next(n.op for n in plain.nodes if n.name == "experts_gate_up").block_m == 128
    block = hf_block(64, 32, 8, 2, True, torch.float32)
    sized = MegaMoE.from_hf(block, options={"block_m": 32, "route_chunk": None})
    assert (
        "block_m" in sized._cutemk_key and sized._cutemk_key != MegaMoE.from_hf(block)._cutemk_key
    )
    for bad, err in ((0, ValueError), (True, TypeError), ("64", TypeError), (None, TypeError)):
        with pytest.raises(err, match="block_m"):
            MegaMoE.from_hf(block, options={"block_m": bad})
    # options go through the regimes' rules: fp32 weights keep the combine step
    from cutemk.regimes import moe_regime_graph as regime_graph

    g = regime_graph(
        256, 128, 8, 2, True, "slots", torch.float32, 2, options={"fused_combine": True}
    )
    assert "moe_combine" in {n.op.name for n in g.nodes}


def test_slots_keep_a_combine_step_where_the_fused_combine_cannot_run():
    """The 'slots' regime fuses the combine into the down tiles only where that tile runs:
    bf16 shapes the Hopper tile does not take (64-row-aligned tiles, a down width or an
    intermediate size TMA cannot box) and sizes the op refuses keep the combine step, so a
    module whose tiles or sizes rule the fused combine out still runs one or two tokens; the
    Qwen3-30B-A3B block keeps it fused."""
    from cutemk.regimes import moe_regime_graph

    def combine_step(h, i, dtype=torch.bfloat16, **options):
        g = moe_regime_graph(h, i, 8, 2, True, "slots", dtype, 64, options=options or None)
        return "moe_combine" in {n.op.name for n in g.nodes}

    assert not combine_step(2048, 768)
    assert combine_step(256, 128, block_m=32)
    assert combine_step(256, 128, down_block_n=24)
    assert combine_step(256, 100)
    assert combine_step(36, 128)
    # the interpreter: a hidden size the fused combine refuses (not a multiple of 4)
    block = hf_block(37, 16, 8, 2, True, torch.float32)
    mega = MegaMoE.from_hf(block, max_tokens=8, backend="interpret")
    for t in (1, 2, 5):
        x = torch.randn(t, 37, generator=torch.Generator().manual_seed(t))
        assert rel_err(mega(x), hf_forward(block, x)) < 1e-5, t


def test_constructor_and_from_hf_refuse_what_the_block_does_not_compute():
    """Biases (the gate's, or 4.x expert MLPs') are refused, not dropped (they changed the
    output silently); zero-size blocks, a bool top_k, a non-bool norm flag, options that are
    not a dict and a bad profile value are refused when the module is built; profiling asks
    for the GPU kernel at the first call on the interpreter."""
    from torch import nn

    from cutemk.errors import CuteMKError, ShapeError

    e, h, i = 4, 32, 16

    class Expert(nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.gate_proj = nn.Linear(h, i, bias=bias)
            self.up_proj = nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)
            self.act_fn = nn.SiLU()

    class Block(nn.Module):  # transformers 4.x's layout: one MLP an expert
        def __init__(self, gate_bias, expert_bias):
            super().__init__()
            self.gate = nn.Linear(h, e, bias=gate_bias)
            self.experts = nn.ModuleList(Expert(expert_bias and j == 2) for j in range(e))
            self.top_k, self.norm_topk_prob = 2, True

    MegaMoE.from_hf(Block(False, False))
    with pytest.raises(ValueError, match="gate.bias"):
        MegaMoE.from_hf(Block(True, False))
    with pytest.raises(ValueError, match="experts\\[2\\].gate_proj.bias"):
        MegaMoE.from_hf(Block(False, True))
    # the HF block's values as found: a top_k of 0 (was 'cannot find top_k', as if unset) or
    # 2.7 (was 2) and a norm flag of "no" (was on) are refused; no experts is named (a
    # torch.stack error)
    for attr, value, match in (
        ("top_k", 0, "top_k must be an int"),
        ("top_k", 2.7, "top_k must be an int"),
        ("norm_topk_prob", "no", "norm_topk_prob must be a bool"),
        ("experts", nn.ModuleList(), "experts is empty"),
    ):
        block = Block(False, False)
        setattr(block, attr, value)
        with pytest.raises((TypeError, ValueError), match=match):
            MegaMoE.from_hf(block)
    wr, wgu, wd = torch.randn(e, h), torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    with pytest.raises(ShapeError, match="at least one expert"):
        MegaMoE(torch.randn(e, 0), torch.randn(e, 2 * i, 0), torch.randn(e, 0, i), top_k=2)
    with pytest.raises(ValueError, match="top_k"):
        MegaMoE(wr, wgu, wd, top_k=True)
    with pytest.raises(TypeError, match="norm_topk_prob"):
        MegaMoE(wr, wgu, wd, top_k=2, norm_topk_prob="no")
    with pytest.raises(TypeError, match="options must be a dict"):
        MegaMoE(wr, wgu, wd, top_k=2, options=["router_topk"])
    with pytest.raises(ValueError, match="profile"):
        MegaMoE(wr, wgu, wd, top_k=2, profile="x")
    with pytest.raises(CuteMKError, match="'cute' backend"):
        MegaMoE(wr, wgu, wd, top_k=2, profile=True, backend="interpret")(torch.randn(3, h))


def test_options_an_op_refuses_in_one_regime_are_refused_when_built():
    """MegaMoE options that one regime's op refuses (a block_m below the slot layout's rows,
    the slot layout past 16 tokens) fail at construction, naming the regime, not at the first
    token count that reaches it."""
    e, h, i = 8, 64, 32
    w = (torch.randn(e, h), torch.randn(e, 2 * i, h), torch.randn(e, h, i))
    with pytest.raises(ValueError, match=r"the 'slots' regime \(up to 2 tokens\) refuses"):
        MegaMoE(*w, top_k=2, max_tokens=40, backend="interpret", options={"block_m": 1})
    with pytest.raises(ValueError, match=r"the 'decode' regime \(up to 40 tokens\) refuses"):
        MegaMoE(*w, top_k=2, max_tokens=40, backend="interpret", options={"slots": True})
    MegaMoE(*w, top_k=2, max_tokens=16, backend="interpret", options={"slots": True})
