"""The decoder layer's megakernels compiled for sm_90a on the CPU: Qwen3-8B and Qwen3-30B-A3B
decode layers for MegaDecoderLayer's batch ranges (no register spills where the house keeps
none), the measuring switches, profiling, the fused tails, the prefill step."""

import os
from dataclasses import replace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from decoder_cases import (
    QWEN3_8B_DECODE,
    QWEN3_30B_DECODE,
    bare_decoder,
)

import cutemk as mk
from cutemk.layers import DecoderConfig, decoder_layer_graph, decoder_prefill_graph
from cutemk.runtime import compile_offline


@pytest.mark.parametrize(
    "which,scheduler,max_batch",
    [
        ("qwen3_8b", "static", 16),
        ("qwen3_8b", "static", 64),
        ("qwen3_8b", "dynamic", 64),
        ("qwen3_30b_a3b", "static", 64),
    ],
)
def test_decode_layer_compiles_for_hopper(
    tmp_path, which, scheduler, max_batch, spill_stores, wgmma_serialized
):
    """Qwen3-8B (dense) and Qwen3-30B-A3B (MoE, MegaMoE's decode tiles) layers, bf16, for
    MegaDecoderLayer's two batch ranges. The static dense layer has no register spills (a
    reduce tile holding more partials once spilled 760 bytes and slowed every tile); the
    dynamic worker and the MoE layer still spill a little (tens / hundreds of bytes)."""
    from cutemk.layers import MoeConfig
    from cutemk.nn import MOE_TILES

    moe = None
    if which == "qwen3_8b":
        cfg = QWEN3_8B_DECODE
    else:
        cfg = QWEN3_30B_DECODE
        moe = MoeConfig(2048, 768, 128, 8, router_dtype=None, **MOE_TILES[("cute", "decode")])
    g = decoder_layer_graph(mk.sym("B", max=max_batch), cfg, torch.bfloat16, moe=moe)
    compile_offline(g, scheduler, options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert "wgmma.mma_async" in ptx  # the projections on the Hopper GEMM
    if which == "qwen3_8b" and scheduler == "static":
        assert spill_stores(ptx_file) == 0
        assert not wgmma_serialized(ptx_file)


@pytest.mark.parametrize(
    "switch", ["CUTEMK_EARLY_HANDOVER", "CUTEMK_EPI_MBARRIER", "CUTEMK_QUEUE_HEAD"]
)
def test_decode_layer_with_a_measuring_switch_off_compiles_for_hopper(
    tmp_path, monkeypatch, spill_stores, switch
):
    """A measuring switch off (``CUTEMK_EARLY_HANDOVER=0``: every task handed over after its
    early loads; ``CUTEMK_EPI_MBARRIER=0``: the staging buffer released by a named barrier;
    ``CUTEMK_QUEUE_HEAD=0``: the queue's range and first records read through the header):
    the Qwen3-8B decode layer, static, still without register spills."""
    monkeypatch.setenv(switch, "0")
    g = decoder_layer_graph(mk.sym("B", max=16), QWEN3_8B_DECODE, torch.bfloat16)
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert spill_stores(ptx_file) == 0


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_profiled_decode_layer_stamps_each_task_phase(tmp_path, scheduler):
    """``profile=True``: the kernel stamps, besides a task's start and end and each CTA's
    entry, roles done and exit, when the producer took the task up, armed its early loads and
    found its events met, when each ring node's first slice landed (in its compute's slot
    waits) and when a ring tile was staged (``cutemk.trace.PHASES``): 10 stamps plus one a
    ring node. ``profile="slices"`` stamps each ring slice's issue and landing as well: more.
    The production kernel has none."""
    g = decoder_layer_graph(mk.sym("B", max=16), QWEN3_8B_DECODE, torch.bfloat16)
    ring_nodes = sum(n.op.ring_tile() is not None for n in g.nodes)
    assert ring_nodes >= 4
    stamps = {}
    for profile in (False, True, "slices"):
        d = tmp_path / str(profile)
        d.mkdir()
        compile_offline(g, scheduler, profile=profile, options=f"--keep-ptx --dump-dir={d}")
        (ptx_file,) = d.glob("*.ptx")
        stamps[profile] = ptx_file.read_text().count("%globaltimer")
    assert stamps[False] == 0
    assert stamps[True] >= 10 + ring_nodes
    assert stamps["slices"] >= stamps[True] + 3  # the producer's 3 issue sites, at least


def test_decode_layer_with_o_proj_prefetching_into_l2_compiles_for_hopper(tmp_path, spill_stores):
    """``DecoderConfig.o_proj_l2_prefetch``: the output projection's tiles TMA-prefetch their
    weight slices into L2 before their events (one prefetch loop in the producer, issued by
    one elected lane: a TMA load elects its lane itself, a prefetch does not), the other
    projections do not; static, no spills. Off, the kernel has no prefetch."""
    import re

    counts = {}
    for on in (False, True):
        cfg = replace(QWEN3_8B_DECODE, o_proj_l2_prefetch=on)
        g = decoder_layer_graph(mk.sym("B", max=16), cfg, torch.bfloat16)
        assert [n.name for n in g.nodes if n.op.ring_tile() and n.op.prefetches_l2] == (
            ["o_proj"] if on else []
        )
        d = tmp_path / str(on)
        d.mkdir()
        compile_offline(g, "static", options=f"--keep-ptx --dump-dir={d}")
        (ptx_file,) = d.glob("*.ptx")
        ptx = ptx_file.read_text()
        counts[on] = len(re.findall(r"cp\.async\.bulk\.prefetch\.tensor", ptx))
        if on:
            assert spill_stores(ptx_file) == 0
            before = ptx[: ptx.index("cp.async.bulk.prefetch.tensor")].splitlines()[-40:]
            assert any("elect.sync" in line for line in before), "the prefetch is not elected"
    assert counts == {False: 0, True: 1}


@pytest.mark.parametrize("fused", ["fused_qkv_tail", "fused_append"])
def test_decode_layer_with_the_fused_tail_compiles_for_hopper(tmp_path, spill_stores, fused):
    """``DecoderConfig.fused_qkv_tail`` (the split QKV projection's partials into
    qk_norm_rope, which appends k and v) and ``fused_append`` (the reduce a phase of its own,
    qk_norm_rope appending): the Qwen3-8B decode layer, static, no spills."""
    cfg = replace(QWEN3_8B_DECODE, **{fused: True})
    g = decoder_layer_graph(mk.sym("B", max=16), cfg, torch.bfloat16)
    first = [n.op.name for n in g.nodes[:4]]
    assert "kv_append" not in first, first
    assert ("gemm_split_reduce" in first) == (fused == "fused_append"), first
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert spill_stores(ptx_file) == 0


def test_decode_layer_with_the_down_reduce_in_its_tiles_compiles_for_hopper(tmp_path, spill_stores):
    """``DecoderConfig.fused_reduce`` (MegaDecoderLayer's graph of up to 16 sequences): o_proj
    (+ residual, the sums of squares gate/up's norm takes) and the down projection (+
    residual) are gemm_split nodes, their last partial tiles adding the ranges; the Qwen3-8B
    decode layer, static, no spills."""
    cfg = replace(QWEN3_8B_DECODE, fused_reduce=True)
    g = decoder_layer_graph(mk.sym("B", max=16), cfg, torch.bfloat16)
    nodes = {n.name: n for n in g.nodes}
    assert "o_proj_sum" not in nodes and "down_sum" not in nodes, list(nodes)
    o, down, gu = nodes["o_proj"], nodes["down"], nodes["gate_up"]
    assert o.op.name == down.op.name == "gemm_split"
    assert o.op.sm90().reduce == down.op.sm90().reduce == "residual"
    assert o.op.sm90().reduce_sumsq and not down.op.sm90().reduce_sumsq
    assert gu.op.norm_ss is not None and gu.op.norm_width == cfg.hidden
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert spill_stores(ptx_file) == 0


@pytest.fixture(scope="module")
def prefill_layer_ptx(tmp_path_factory):
    """The PTX file of Qwen3-8B's prefill step (``decoder_prefill_graph``, bf16, up to 8192
    tokens, static), compiled once for the tests below."""
    d = tmp_path_factory.mktemp("prefill_layer")
    compile_offline(_qwen3_8b_prefill_graph(), "static", options=f"--keep-ptx --dump-dir={d}")
    (ptx_file,) = d.glob("*.ptx")
    return ptx_file


def _qwen3_8b_prefill_graph():
    cfg = DecoderConfig(
        hidden=4096,
        intermediate=12288,
        heads=32,
        kv_heads=8,
        head_dim=128,
        page_size=16,
        max_pages=1025,
        max_positions=16385,
        block_m=128,
        block_n=128,
        fold_norms=True,
    )
    return decoder_prefill_graph(mk.sym("T", max=8192), mk.sym("B", max=64), cfg, torch.bfloat16)


def test_prefill_layer_compiles_for_hopper(prefill_layer_ptx):
    """Qwen3-8B's prefill step (``decoder_prefill_graph``) as one kernel for sm_90a: the
    projections on the Hopper GEMM, the append and the causal attention on the tensor cores.
    (Register spills of this kernel: see benchmarks/NOTES.md.)"""
    ptx = prefill_layer_ptx.read_text()
    assert "wgmma.mma_async" in ptx
    # the attention's S = q K^T (the projections' tiles are 128 wide)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
    assert "mma.sync" not in ptx


@pytest.mark.xfail(
    strict=True,
    reason="known: the prefill attention's last P V sits under a branch with its wgmma.fence "
    "outside it, and ptxas serializes every wgmma of the layer kernel (C7520); see "
    "benchmarks/NOTES.md",
)
def test_prefill_layer_wgmma_is_not_serialized(prefill_layer_ptx, wgmma_serialized):
    assert not wgmma_serialized(prefill_layer_ptx)


def test_moe_decode_layer_on_the_slot_layout_compiles_for_hopper(tmp_path):
    """MegaDecoderLayer's 'slots' regime of a Qwen3-30B-A3B layer (one or two sequences), the
    graph the module builds: the sparse block on MegaMoE's 'slots' tiles, the q/k/v tail one
    phase, bf16, static, for sm_90a."""
    from cutemk.layers import MoeConfig

    moe = MoeConfig(2048, 768, 128, 8, router_dtype=None, block_m=64, block_n=64)
    mega = bare_decoder(QWEN3_30B_DECODE, moe)
    g = mega.regime_graph("slots", torch.bfloat16)
    names = {n.op.name for n in g.nodes}
    assert "moe_route" not in names and "kv_append" not in names, names
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert "wgmma.mma_async" in ptx
    # the gate/up tiles 48 columns wide: a warpgroup's half of them is one n24 wgmma
    assert "wgmma.mma_async.sync.aligned.m64n24k16" in ptx


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3-8b", "qwen3-30b-a3b"])
def test_decode_layer_with_the_batched_merge_compiles_for_hopper(tmp_path, spill_stores, moe):
    """``DecoderConfig.attention_merge_batched`` (decode attention's last range merging in two
    steps): the Qwen3-8B layer (no spills) and the Qwen3-30B-A3B layer's 'slots' regime (no
    more spill stores than the same kernel with the one-pass merge: it has some), static."""
    from cutemk.layers import MoeConfig

    def spills(merge: bool) -> int:
        if moe:
            cfg = replace(QWEN3_30B_DECODE, attention_merge_batched=merge)
            block = MoeConfig(2048, 768, 128, 8, router_dtype=None, block_m=64, block_n=64)
            g = bare_decoder(cfg, block).regime_graph("slots", torch.bfloat16)
        else:
            cfg = replace(QWEN3_8B_DECODE, attention_merge_batched=merge)
            g = decoder_layer_graph(mk.sym("B", max=16), cfg, torch.bfloat16)
        (att,) = [n.op for n in g.nodes if n.op.name == "attention_decode"]
        assert att.merge_batched == att.sm90().merge_batched == merge
        d = tmp_path / str(merge)
        d.mkdir()
        compile_offline(g, "static", options=f"--keep-ptx --dump-dir={d}")
        (ptx_file,) = d.glob("*.ptx")
        return spill_stores(ptx_file)

    if moe:
        assert spills(True) <= spills(False)
    else:
        assert spills(True) == 0


def test_moe_decode_layer_defaults_take_the_measured_switches():
    """By default (``moe_router_topk`` and ``attention_merge_batched`` None) the Qwen3-30B-A3B
    layer's 'slots' regime has the router pick in its last tile (MegaMoE's 'slots' tiles) and
    the 'gemv' regime keeps the top-k phase; decode attention merges in two steps."""
    from cutemk.layers import MoeConfig

    block = MoeConfig(2048, 768, 128, 8, router_dtype=None, block_m=64, block_n=64)
    for regime, topk_phase in (("slots", False), ("gemv", True)):
        g = bare_decoder(QWEN3_30B_DECODE, block).regime_graph(regime, torch.bfloat16)
        assert ("topk_softmax" in {n.op.name for n in g.nodes}) == topk_phase, regime
        (att,) = [n.op for n in g.nodes if n.op.name == "attention_decode"]
        assert att.batched_merge and att.sm90().merge_batched


@pytest.mark.parametrize("regime", ["slots", "gemv"])
def test_moe_decode_layer_with_the_norm_in_o_proj_reduce_compiles_for_hopper(
    tmp_path, spill_stores, regime
):
    """``DecoderConfig.post_norm_in_reduce``, ``moe_residual_in_combine`` and
    ``moe_router_topk``: the Qwen3-30B-A3B layer's decode regimes without an mlp_norm phase
    (o_proj's reduce writes the normalised rows, 2048 columns a tile), a residual phase (the
    combine adds it: in the down tiles in the 'slots' regime, in ``moe_combine`` in 'gemv')
    nor, in 'slots', a top-k phase (the router's last tile picks), static, for sm_90a, with no
    more spill stores than the same kernel with the phases."""
    from cutemk.layers import MoeConfig

    def spills(on: bool) -> int:
        cfg = replace(
            QWEN3_30B_DECODE,
            post_norm_in_reduce=on,
            moe_residual_in_combine=on,
            moe_router_topk=on,
        )
        block = MoeConfig(2048, 768, 128, 8, router_dtype=None, block_m=64, block_n=64)
        g = bare_decoder(cfg, block).regime_graph(regime, torch.bfloat16)
        names = {n.name for n in g.nodes}
        assert ("mlp_norm" in names) != on and ("residual" in names) != on, names
        # the router picks in its last tile at one or two sequences only ('slots')
        fused_topk = on and regime == "slots"
        assert ("topk_softmax" in {n.op.name for n in g.nodes}) != fused_topk, names
        d = tmp_path / str(on)
        d.mkdir()
        compile_offline(g, "static", options=f"--keep-ptx --dump-dir={d}")
        (ptx_file,) = d.glob("*.ptx")
        return spill_stores(ptx_file)

    assert spills(True) <= spills(False)
