"""The MoE block on the Hopper path: permute + grouped GEMMs on TMA/wgmma through the ring.

CPU: the bf16 MoE megakernel compiles for sm_90a with the expert as a TMA coordinate (3-D
weight loads), wgmma and TMA stores. GPU: the whole block against the fp32 reference over
random routings, all tokens to one expert, an empty expert and tied logits, at a small size
and at Qwen3-30B-A3B's size, both schedulers, NaN-poisoned outputs, and bit-identical results
from run to run.
"""

import dataclasses
import os
import re

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk.layers import MoeConfig, moe_graph, moe_reference
from cutemk.nn import MOE_TILES
from cutemk.regimes import moe_tiles
from cutemk.runtime import compile_offline

SMALL = MoeConfig(512, 256, 16, 4, block_m=64, block_n=64, down_block_n=128)
QWEN3_30B = MoeConfig(2048, 768, 128, 8, block_m=64, block_n=64, down_block_n=128)
PREFILL = MoeConfig(2048, 768, 128, 8, router_dtype=None, **MOE_TILES[("cute", "prefill")])


def _count(pattern: str, ptx: str) -> int:
    return len(re.findall(pattern, ptx))


@pytest.mark.parametrize(
    "scheduler,regime",
    [("static", "decode"), ("dynamic", "decode"), ("static", "prefill")],
)
def test_moe_megakernel_compiles_for_hopper(tmp_path, scheduler, regime):
    """MegaMoE's decode and prefill graphs at Qwen3-30B-A3B's size (their tiles and the route's
    shared memory leave room for the ring)."""
    cfg = dataclasses.replace(QWEN3_30B, router_split=8) if regime == "decode" else PREFILL
    g = moe_graph(mk.sym("T", max=4096), cfg, torch.bfloat16)
    compile_offline(g, scheduler, options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    # gate/up (gate and up halves) and down weights: 3-D loads, the expert a coordinate
    assert _count(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global", ptx) >= 3
    assert _count(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", ptx) >= 3  # TMA stores
    assert _count(r"wgmma\.mma_async", ptx) >= 3
    assert _count(r"fence\.proxy\.async", ptx) >= 2
    assert _count(r"setmaxnreg", ptx) == 2
    # mbarriers live in the kernel's own shared memory (no op's scratch overlaps them) and are
    # initialised once, in the prologue, before any wait on them: none is ever re-initialised,
    # so the PTX lifecycle needs no mbarrier.inval
    inits = [m.start() for m in re.finditer(r"mbarrier\.init\.", ptx)]
    waits = [m.start() for m in re.finditer(r"mbarrier\.try_wait", ptx)]
    assert inits and waits and max(inits) < min(waits)
    # the wide SIMT bodies (both consumer warpgroups, barrier 2): top-k, permute and combine
    # each end on it; none of them uses the shared scratch (permute and combine load their
    # slot rows a thread at a time), so none meets the other warpgroup before its body
    wide = {n.op.name for n in g.nodes if n.op.ring_tile() is None and n.op.simt_threads == 256}
    assert wide == {"topk_softmax", "moe_permute", "moe_combine"}, wide
    assert all(n.op.device_smem_bytes() == 0 for n in g.nodes if n.op.name in wide)
    assert _count(r"\bbarrier\.sync\s+2,\s*256", ptx) == 3


def _weights(cfg: MoeConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate
    return dict(
        w_router=torch.randn(e, h, generator=gen, device="cuda").bfloat16(),
        w_gate_up=(torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5).bfloat16(),
        w_down=(torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5).bfloat16(),
    )


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    return ((out.float() - ref).norm() / ref.norm()).item()


def _run(
    cfg: MoeConfig,
    scheduler: str,
    tokens,
    routings=("random",),
    max_tokens=4096,
):
    gen = torch.Generator(device="cuda").manual_seed(5)
    c = moe_graph(mk.sym("T", max=max_tokens), cfg, torch.bfloat16).compile(
        "cute", scheduler=scheduler, watchdog=True, poison_outputs=True
    )
    for routing in routings:
        w = _weights(cfg, gen)
        if routing == "one_expert":  # x[:, 0] = 4 pushes every token to expert 3, none to 5
            w["w_router"][:, 0] = 0.0
            w["w_router"][3, 0] = 25.0
            w["w_router"][5, 0] = -25.0
        if routing == "ties":  # every logit equal: the lowest ids win, all with weight 1/k
            w["w_router"].zero_()
        for t in tokens:
            x = torch.randn(t, cfg.hidden, generator=gen, device="cuda").bfloat16()
            if routing == "one_expert":
                x[:, 0] = 4.0
            y = c(x, **w)
            ref = moe_reference(
                x, **w, top_k=cfg.top_k, router_dtype=cfg.router_dtype or torch.bfloat16
            )
            err = _rel_err(y, ref)
            assert err < 1e-2, f"{routing} T={t}: rel err {err:.3g}"
            for _ in range(2):  # deterministic: no atomics in the data path
                assert torch.equal(c(x, **w), y), f"{routing} T={t}: not bit-identical"


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_hopper_router_split(scheduler):
    """The router as 4 K ranges whose partials the top-k sums and rounds to bf16 (MegaMoE's
    decode graphs): the reference routes on bf16 logits too."""
    cfg = dataclasses.replace(SMALL, router_split=4, router_dtype=None)
    _run(cfg, scheduler, (1, 5, 64, 300), ("random", "one_expert", "ties"), 512)


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_hopper_small(scheduler):
    _run(SMALL, scheduler, (1, 5, 64, 300, 1000), ("random", "one_expert", "ties"), 1024)


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_hopper_qwen3_30b(scheduler):
    _run(QWEN3_30B, scheduler, (1, 7, 129, 1000))


@pytest.mark.gpu
def test_moe_hopper_hundred_routings():
    """100 routings at Qwen3-30B-A3B's size: T from 1 to 4096 (odd counts among them), random
    logits, all tokens' top-1 to one expert with another expert empty, and exact ties; both
    schedulers; against the fp32 reference, and bit-identical over 10 runs each."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    kinds = ("random", "one_expert", "ties", "random")
    tokens = (1, 3, 16, 37, 128, 255, 513, 1000, 2047, 4096)
    compiled = {
        s: moe_graph(mk.sym("T", max=4096), QWEN3_30B, torch.bfloat16).compile(
            "cute", scheduler=s, watchdog=True, poison_outputs=True
        )
        for s in ("static", "dynamic")
    }
    w = _weights(QWEN3_30B, gen)
    for case in range(100):
        routing = kinds[case % len(kinds)]
        t = tokens[(case * 7) % len(tokens)]
        c = compiled["static" if case % 2 == 0 else "dynamic"]
        wr = w["w_router"].clone()
        if routing == "one_expert":
            wr[:, 0] = 0.0
            wr[3, 0] = 25.0
            wr[5, 0] = -25.0
        if routing == "ties":
            wr.zero_()
        x = torch.randn(t, QWEN3_30B.hidden, generator=gen, device="cuda").bfloat16()
        if routing == "one_expert":
            x[:, 0] = 4.0
        args = dict(w, w_router=wr)
        y = c(x, **args)
        err = _rel_err(y, moe_reference(x, **args, top_k=QWEN3_30B.top_k))
        assert err < 1e-2, f"case {case} ({routing}, T={t}): rel err {err:.3g}"
        for _ in range(9):
            assert torch.equal(c(x, **args), y), f"case {case} ({routing}, T={t}): not identical"


def test_moe_worker_shapes_leave_a_deep_ring():
    """MegaMoE's kernels' shared memory: the one-task route's 16-bit counters (34 KB at E=128)
    leave the decode graph 7 ring slots; the prefill graph's routing spread over SMs needs 2 KB,
    which leaves it 5 (the ring depth measured to matter most at prefill sizes)."""
    from cutemk.runtime import kernel_spec

    decode = MoeConfig(2048, 768, 128, 8, router_dtype=None, **MOE_TILES[("cute", "decode")])
    for cfg, stages, scratch in ((decode, 7, 35 * 1024), (PREFILL, 5, 2048)):
        w = kernel_spec(moe_graph(mk.sym("T", max=4096), cfg, torch.bfloat16), False).worker
        assert w.ring_stages == stages and w.scratch_bytes <= scratch, w


def test_moe_graph_with_512_experts_fits_by_default():
    """Qwen3-Next's 512 experts: the default router tile is 64 experts wide (a tile of all 512
    experts' logits needed 128 KB of output staging beside the one-task route's 133 KB of
    counters, and no two ring slots fitted)."""
    from cutemk.runtime import kernel_spec

    cfg = MoeConfig(2048, 512, 512, 10, block_m=64, block_n=64, down_block_n=128)
    g = moe_graph(mk.sym("T", max=4096), cfg, torch.bfloat16)
    assert next(n for n in g.nodes if n.name == "router").op.block_n == 64
    assert kernel_spec(g, False).worker.ring_stages >= 2


def test_moe_with_512_experts_compiles_without_spills_and_matches_torch(tmp_path, spill_stores):
    """Qwen3-Next's 512 experts (top-10) end to end on the CPU: the decode graph's megakernel at
    real size compiles for sm_90a with its route's counters and a ring that fit and no spills;
    a small-hidden layer with 512 experts, on the interpreter (what the device computes, tile by
    tile), matches the fp32 token-by-expert reference."""
    cfg = MoeConfig(2048, 512, 512, 10, block_m=64, block_n=64, down_block_n=128)
    g = moe_graph(mk.sym("T", max=4096), cfg, torch.bfloat16)
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert _count(r"wgmma\.mma_async", ptx_file.read_text()) >= 3
    assert spill_stores(ptx_file) == 0

    small = MoeConfig(64, 32, 512, 10, block_m=16, block_n=32)
    gen = torch.Generator().manual_seed(5)
    w = dict(
        w_router=torch.randn(512, 64, generator=gen),
        w_gate_up=torch.randn(512, 64, 64, generator=gen) / 8,
        w_down=torch.randn(512, 64, 32, generator=gen) / 32**0.5,
    )
    c = moe_graph(mk.sym("T", max=64), small).compile("interpret", num_sms=8, seed=1)
    for t in (1, 37):
        x = torch.randn(t, 64, generator=gen)
        y = c(x, **w)
        ref = moe_reference(x, **w, top_k=10)
        assert not torch.isnan(y).any()
        assert ((y - ref).norm() / ref.norm()).item() < 1e-5


# MegaMoE's 'slots' tiles at Qwen3-30B-A3B's size (gate/up 48 columns wide: 128 tiles a token)
SLOTS = MoeConfig(
    2048,
    768,
    128,
    8,
    router_dtype=None,
    **moe_tiles("slots", 2048, "cute", torch.bfloat16, intermediate=768, top_k=8),
)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_slot_layout_compiles_for_hopper(tmp_path, scheduler, spill_stores):
    """MegaMoE's 'slots' graph (``MoeConfig.slots``: the grouped GEMMs on the top-k's ids)
    at Qwen3-30B-A3B's size: no routing node, no top-k node (the router's last tile picks)
    and no combine node (the down tiles sum the picks), the expert a TMA coordinate, no
    spills."""
    g = moe_graph(mk.sym("T", max=2), SLOTS, torch.bfloat16)
    assert [n.op.name for n in g.nodes] == ["gemm_split", "moe_grouped_gemm", "moe_grouped_gemm"]
    compile_offline(g, scheduler, options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert _count(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global", ptx) >= 3
    assert _count(r"wgmma\.mma_async", ptx) >= 3
    assert spill_stores(ptx_file) == 0


def _odd_slots(k: int) -> MoeConfig:
    """A slot-layout block whose hidden size is not a multiple of the down tile (320 = 2 x 128
    + 64: the last column block is partial) with top-k ``k``."""
    return MoeConfig(
        320,
        128,
        8,
        k,
        router_dtype=None,
        block_m=64,
        block_n=64,
        down_block_n=128,
        slots=True,
        fused_combine=True,
    )


@pytest.mark.parametrize("k", [1, 3])
def test_odd_slot_layout_compiles_for_hopper(tmp_path, k, spill_stores):
    g = moe_graph(mk.sym("T", max=2), _odd_slots(k), torch.bfloat16)
    assert "moe_combine" not in [n.op.name for n in g.nodes]
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_hopper_fused_combine_odd_shapes(scheduler, k):
    """The combine in the down tiles with a partial last column block and k = 1 or 3 against
    the fp32 reference, bit-identical reruns (the pick order is fixed)."""
    _run(_odd_slots(k), scheduler, (1, 2), ("random", "ties"), 2)


@pytest.mark.parametrize(
    "dtype, arch, fused",
    [
        (torch.bfloat16, "sm_90a", True),
        (torch.float32, "sm_90a", False),
        (torch.bfloat16, "sm_80", False),
    ],
)
def test_slots_regime_fuses_the_combine_only_on_the_hopper_tile(monkeypatch, dtype, arch, fused):
    """Only the Hopper tile has the combine in the down tiles: an fp32 block (SIMT tiles) or
    another arch keeps the combine step, so its 'slots' graph still has a device path; the
    interpreter runs the fused graph whatever the dtype."""
    from cutemk.regimes import moe_regime_graph

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    names = [n.op.name for n in moe_regime_graph(256, 128, 8, 2, True, "slots", dtype, 2).nodes]
    assert ("moe_combine" not in names) == fused, names
    g = moe_regime_graph(256, 128, 8, 2, True, "slots", dtype, 2, backend="interpret")
    assert "moe_combine" not in [n.op.name for n in g.nodes]


def test_slots_fp32_compiles_with_its_combine_step(tmp_path, monkeypatch):
    """The fp32 'slots' graph compiles (SIMT grouped GEMMs and the combine step)."""
    from cutemk.regimes import moe_regime_graph

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    g = moe_regime_graph(256, 128, 8, 2, True, "slots", torch.float32, 2)
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("max_t", [1, 2])
def test_moe_hopper_slot_layout(scheduler, max_t):
    """The slot layout on the GPU at Qwen3-30B-A3B's size: random, one-expert and tied
    routings against the fp32 reference (bf16 logits), bit-identical reruns; then a router
    whose logits are NaN but one expert's: no expert for the other picks, every output NaN
    (the gate/up tiles of picks without an expert do not exist, their down tiles stream expert
    0 and contribute NaN; nothing is read outside a buffer)."""
    _run(SLOTS, scheduler, tuple(range(1, max_t + 1)), ("random", "one_expert", "ties"), max_t)
    c = moe_graph(mk.sym("T", max=max_t), SLOTS, torch.bfloat16).compile(
        "cute", scheduler=scheduler, watchdog=True, poison_outputs=True
    )
    gen = torch.Generator(device="cuda").manual_seed(9)
    w = _weights(SLOTS, gen)
    w["w_router"][1:, 0] = float("nan")
    x = torch.randn(max_t, SLOTS.hidden, generator=gen, device="cuda").bfloat16()
    assert torch.isnan(c(x, **w)).all()
    w = _weights(SLOTS, gen)  # and the same kernel is fine again with good data
    y = c(x, **w)
    ref = moe_reference(x, **w, top_k=SLOTS.top_k, router_dtype=torch.bfloat16)
    assert _rel_err(y, ref) < 1e-2


# -- the router's last partial tile runs the top-k (``MoeConfig.router_topk``) ----------------
BF16 = torch.bfloat16
ROUTER_TOPK = dataclasses.replace(QWEN3_30B, router_split=8, router_dtype=None, router_topk=True)


def test_router_topk_replaces_the_topk_phase():
    """With ``router_topk`` the router is one ``gemm_split`` node whose outputs include the
    picks (no topk_softmax node); unsplit routers, experts that are not one 128-wide block and
    fp32 (no Hopper tile) keep the top-k phase."""

    def names(cfg, dtype=torch.bfloat16):
        g = moe_graph(mk.sym("T", max=2), cfg, dtype)
        return [n.op.name for n in g.nodes]

    fused = names(ROUTER_TOPK)
    assert "topk_softmax" not in fused and fused[0] == "gemm_split", fused
    router = moe_graph(mk.sym("T", max=2), ROUTER_TOPK, torch.bfloat16).nodes[0]
    assert router.op.topk == 8 and router.op.block_n == 128 and router.op.sm90().reduce_topk
    for cfg, dtype in (
        (dataclasses.replace(ROUTER_TOPK, router_split=1), torch.bfloat16),
        (dataclasses.replace(ROUTER_TOPK, num_experts=64), torch.bfloat16),
        (ROUTER_TOPK, torch.float32),
    ):
        assert "topk_softmax" in names(cfg, dtype), (cfg, dtype)
    # more than two tokens (layers.ROUTER_TOPK_MAX_ROWS): a live count below its plan's would
    # have the router pick experts for the tokens between them; the top-k phase skips those
    for t_max in (3, 16, 512):
        big = moe_graph(mk.sym("T", max=t_max), ROUTER_TOPK, torch.bfloat16)
        assert "topk_softmax" in {n.op.name for n in big.nodes}, t_max


def test_router_topk_rows_are_always_a_planned_count():
    """What makes ``ROUTER_TOPK_MAX_ROWS`` safe: a live kernel plans every count up to it
    (``live_counts``), so a live count there always runs its own plan and the router's top-k
    never picks for rows past it. A change to the live ladder must keep this."""
    from cutemk.live import live_counts
    from cutemk.moe_layers import ROUTER_TOPK_MAX_ROWS

    for last in (ROUTER_TOPK_MAX_ROWS, 16, 4096):
        assert set(range(1, ROUTER_TOPK_MAX_ROWS + 1)) <= set(live_counts(1, last)), last


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("regime", ["slots", "routed"])
def test_router_topk_matches_the_topk_phase_on_the_interpreter(scheduler, regime):
    """bf16 on the interpreter (what the device computes, tile by tile): the block with the
    top-k in the router's last tile gives bit for bit the outputs of the block with the top-k
    phase (both pick on the logits rounded to bf16), over random, tied and NaN logits, on the
    slot layout and on the routed one (moe_route reading the router's ids)."""
    tiles = dict(slots=True, fused_combine=True) if regime == "slots" else {}
    small = dataclasses.replace(ROUTER_TOPK, hidden=512, intermediate=64, **tiles)
    max_t = 2
    runs = [
        moe_graph(mk.sym("T", max=max_t), dataclasses.replace(small, router_topk=on), BF16).compile(
            "interpret", num_sms=8, scheduler=scheduler
        )
        for on in (False, True)
    ]
    gen = torch.Generator().manual_seed(21)
    e, h, i = small.num_experts, small.hidden, small.intermediate
    for routing in ("random", "ties", "nan"):
        w = dict(
            w_router=(torch.randn(e, h, generator=gen) / h**0.5).to(BF16),
            w_gate_up=(torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(BF16),
            w_down=(torch.randn(e, h, i, generator=gen) / i**0.5).to(BF16),
        )
        if routing == "ties":
            w["w_router"].zero_()
        if routing == "nan":  # every token's logits NaN but one expert's: no expert, NaN out
            w["w_router"][1:, 0] = float("nan")
        for t in (1, max_t):
            x = torch.randn(t, h, generator=gen).to(BF16)
            want, got = (run(x, **w) for run in runs)
            assert torch.equal(got.isnan(), want.isnan()), f"{routing} T={t}"
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{routing} T={t}"


@pytest.mark.parametrize("regime", ["slots", "routed"])
def test_router_topk_compiles_for_hopper(tmp_path, regime, spill_stores):
    """The Qwen3-30B-A3B block with the top-k in the router's last tile compiles for sm_90a:
    its picks are two warp reductions (the PTX's redux.sync), no spills beyond the block's."""
    tiles = dict(slots=True, fused_combine=True) if regime == "slots" else {}
    cfg = dataclasses.replace(ROUTER_TOPK, **tiles)
    g = moe_graph(mk.sym("T", max=2), cfg, BF16)
    assert "topk_softmax" not in {n.op.name for n in g.nodes}
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert _count(r"redux\.sync\.max\.s32", ptx) == 1 and _count(r"redux\.sync\.min\.s32", ptx) == 1
    assert spill_stores(ptx_file) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("regime", ["slots", "routed"])
def test_moe_hopper_router_topk(scheduler, regime):
    """The router's last tile picking the experts on the GPU: random, one-expert and tied
    routings against the fp32 reference on bf16 logits, bit-identical reruns."""
    if regime == "slots":
        cfg = dataclasses.replace(ROUTER_TOPK, slots=True, fused_combine=True)
        _run(cfg, scheduler, (1, 2), ("random", "one_expert", "ties"), 2)
    else:
        _run(ROUTER_TOPK, scheduler, (1, 2), ("random", "one_expert", "ties"), 2)


def test_routing_ops_check_the_experts_of_a_router_that_picks():
    """moe_route / moe_route_count / the slot layout's grouped GEMM read ids from a router
    that runs the top-k as from ``topk_softmax``: a different expert count is a GraphError."""
    from cutemk import ops

    def graph_with(op, *args, **kw):
        g = mk.Graph("picks")
        t = mk.sym("T", max=2)
        x = g.input("x", (t, 512), BF16)
        w = g.weight("w_router", (128, 512), BF16)
        router = ops.gemm_split(x.spec, w.spec, split_k=4, block_n=128, topk=8)
        assert router.picks_over == 128
        _, _, _, _, ids = g.call(router, x, w, name="router")
        named = {"x": x, "ids": ids, "w_gu": g.weight("w_gu", (64, 128, 512), BF16)}
        out = g.call(op, *(named[a] for a in args), **kw)
        g.output(out[0] if isinstance(out, tuple) else out, "y")
        return g

    for op, args, kw in (
        (ops.moe_route, ("ids",), dict(num_experts=64)),
        (ops.moe_route_count, ("ids",), dict(num_experts=64, chunk=64)),
        (ops.moe_slot_gemm, ("x", "w_gu", "ids"), dict(slot_input="tokens", block_n=64)),
    ):
        with pytest.raises(mk.errors.GraphError, match="64 experts|over 128"):
            graph_with(op, *args, **kw).validate()
