"""A decode step's batch as device data (``MegaDecoderLayer.forward(..., num_tokens=n)``): one
CUDA-graph capture for every batch. CPU: the module on the interpreter, the ops' references
with rows past the live extents, the live dims of each regime's graph, the live kernels
compiled for sm_90a. GPU: a dense and a MoE layer captured once and replayed at batches in
random order, the rows past the batch aimed at a page no sequence owns."""

import os
from dataclasses import replace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from decoder_cases import (
    CFG,
    GPU_CFG,
    QWEN3_8B_DECODE,
    QWEN3_30B_DECODE,
    bare_decoder,
    hf_layer,
    hf_moe_layer,
    step_case,
)

import cutemk as mk
from cutemk.layers import decoder_layer_graph
from cutemk.runtime import compile_offline


def _padded(inputs, rows: int, gen):
    """``inputs`` of a decode step padded to ``rows`` sequences with garbage that would do
    harm if used: the extra rows' page tables point at the first live sequence's pages, their
    lengths and positions at its last slot."""
    b = inputs["x"].shape[0]
    extra = rows - b
    out = dict(inputs)
    out["x"] = torch.cat(
        [inputs["x"], 1e3 * torch.randn(extra, inputs["x"].shape[1], generator=gen)]
    )
    out["positions"] = torch.cat([inputs["positions"], inputs["positions"][:1].repeat(extra)])
    out["page_table"] = torch.cat([inputs["page_table"], inputs["page_table"][:1].repeat(extra, 1)])
    out["seq_lens"] = torch.cat([inputs["seq_lens"], inputs["seq_lens"][:1].repeat(extra)])
    return out


def test_forward_live_steps_the_live_sequences_and_leaves_the_rest_alone():
    """``MegaDecoderLayer.forward(..., num_tokens=n)`` on the interpreter: inputs at
    max_batch rows, the first n sequences stepped as a step of those n alone (output and
    caches), the rows past n absent although their page tables point at a live sequence's
    pages; shapes past max_batch, counts out of range and prefill steps refused."""
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, rotary = hf_layer(CFG)
    kw = dict(page_size=CFG.page_size, max_pages=CFG.max_pages, max_positions=256)
    mega = MegaDecoderLayer.from_hf(layer, **kw, max_batch=5, backend="interpret")
    gen = torch.Generator().manual_seed(8)
    inputs, want = step_case(layer, rotary, CFG, [3, 40, 17], gen)
    padded = _padded(inputs, 5, gen)
    n = torch.tensor([3], dtype=torch.int32)
    k0, v0 = padded["k_cache"].clone(), padded["v_cache"].clone()
    y = mega(**padded, num_tokens=n)
    assert y.shape == (5, CFG.hidden)
    torch.testing.assert_close(y[:3], want, rtol=1e-4, atol=1e-4)
    alone = {**inputs, "k_cache": k0, "v_cache": v0}
    torch.testing.assert_close(y[:3], mega(**alone), rtol=0, atol=0)
    assert torch.equal(padded["k_cache"], k0) and torch.equal(padded["v_cache"], v0)
    with pytest.raises(mk.errors.ShapeError, match="max_batch=5"):
        mega(**inputs, num_tokens=n)
    with pytest.raises(mk.CuteMKError, match="outside"):
        mega(**padded, num_tokens=torch.tensor([6], dtype=torch.int32))
    with pytest.raises(mk.CuteMKError, match="prefill"):
        mega(**padded, cu_seqlens=torch.tensor([0, 1], dtype=torch.int32), num_tokens=n)
    with pytest.raises(ValueError, match="pages="):
        mk.warmup(mega, live=True, progress=False)


def test_decode_graphs_bind_the_sequences_to_the_live_batch():
    """Each decode regime's graph of a Qwen3-8B layer takes its batch as device data: the
    positions, page table and lengths bound to the live count (every reader treats rows past
    their extent as absent), the caches updated in place only by ops that skip those rows,
    the caches' page count fixed per live graph; the live kernel compiles for sm_90a."""
    from cutemk.kernels import live_dims

    mega = bare_decoder(QWEN3_8B_DECODE)
    for regime, _ in mega.decode_regime_starts():
        g = mega.regime_graph(regime, torch.bfloat16)
        pairs, extents = live_dims(g, "B", ("pages",))
        at_live = {g.values[i].name for i, _, j in pairs if j < 0}
        assert at_live == {"positions", "page_table", "seq_lens"}, (regime, at_live)
        assert all("pages" not in str(e) for e in extents)
        with pytest.raises(mk.errors.GraphError, match="pages"):
            live_dims(g, "B")  # the page count must be fixed
    # a reader of the page table that does not treat rows past the live count as absent
    # leaves it bound to the plan's count: the append steered by it is refused
    g = mega.regime_graph("gemv", torch.bfloat16)
    attention = next(n for n in g.nodes if n.op.name == "attention_decode")
    object.__setattr__(attention.op, "live_rows_inputs", ())
    with pytest.raises(mk.errors.GraphError, match="in place"):
        live_dims(g, "B", ("pages",))


@pytest.mark.parametrize("fused_tail", [True, False])
def test_live_decode_layer_compiles_for_hopper(tmp_path, spill_stores, fused_tail):
    """The live kernels of both q/k/v tails: the append fused into qk_norm_rope, or kv_append."""
    g = decoder_layer_graph(
        mk.sym("B", max=16), replace(QWEN3_8B_DECODE, fused_qkv_tail=fused_tail), torch.bfloat16
    )
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}", live="B")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert "wgmma.mma_async" in ptx_file.read_text()
    assert spill_stores(ptx_file) == 0


def test_live_moe_decode_layer_compiles_for_hopper(tmp_path):
    """Qwen3-30B-A3B's decode layer with its batch as device data: the sparse block's top-k
    bound to the live count too (the absent rows route nowhere), besides the sequences."""
    from cutemk.kernels import live_dims
    from cutemk.layers import MoeConfig
    from cutemk.nn import MOE_TILES

    moe = MoeConfig(2048, 768, 128, 8, router_dtype=None, **MOE_TILES[("cute", "decode")])
    g = decoder_layer_graph(mk.sym("B", max=64), QWEN3_30B_DECODE, torch.bfloat16, moe=moe)
    pairs, _ = live_dims(g, "B", ("pages",))
    at_live = {g.values[i].name for i, _, j in pairs if j < 0}
    assert {"positions", "page_table", "seq_lens"} < at_live and len(at_live) == 4
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}", live="B")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert "wgmma.mma_async" in ptx_file.read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("block", ["dense", "moe"])
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_decoder_layer_captured_once_replays_every_batch(scheduler, block):
    """One CUDA graph of ``MegaDecoderLayer.forward(..., num_tokens=n)`` over 20 sequences'
    buffers (every decode regime; a dense and a MoE layer), replayed at batches in random
    order: the first n sequences match HF's layer and their caches a step of those n alone;
    the rows past n are garbage whose appends would land in the one page no sequence owns,
    which must come back unchanged."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    import random

    from cutemk.nn import MegaDecoderLayer

    rows = 20
    if block == "dense":
        cfg = GPU_CFG
        layer, rotary = hf_layer(cfg)
    else:  # the sparse block's top-k is bound to the live count too: absent rows route nowhere
        cfg = replace(GPU_CFG, intermediate=256)
        layer, rotary = hf_moe_layer(cfg, 8, 2, 256)
    gen = torch.Generator().manual_seed(9)
    lens = [int(v) for v in torch.randint(1, 300, (rows,), generator=gen)]
    inputs, want = step_case(layer, rotary, cfg, lens, gen)
    mega = MegaDecoderLayer.from_hf(
        layer.to(torch.bfloat16),
        page_size=cfg.page_size,
        max_pages=cfg.max_pages,
        max_positions=cfg.max_positions,
        max_batch=rows,
        scheduler=scheduler,
    ).cuda()
    case = {k: v.cuda() for k, v in inputs.items()}
    for k in ("x", "k_cache", "v_cache"):
        case[k] = case[k].bfloat16()
    static = {k: v.clone() for k, v in case.items()}
    n = torch.full((1,), rows, dtype=torch.int32, device="cuda")
    mega(**static, num_tokens=n)  # outside the capture: live graphs built, kernels loaded
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mega(**static, num_tokens=n)
    counts = [1, 20, 3, 8, 9, 0, 16, 17, 5, 12, 1]
    random.Random(2).shuffle(counts)
    # the one page no sequence owns: the garbage rows aim their appends at it
    page = cfg.page_size
    owned = {int(case["page_table"][b, i]) for b in range(rows) for i in range(-(-lens[b] // page))}
    (spare,) = set(range(case["k_cache"].shape[0])) - owned
    for t in counts:
        for k in ("k_cache", "v_cache"):
            static[k].copy_(case[k])
        for k in ("x", "positions", "page_table", "seq_lens"):
            static[k][:t] = case[k][:t]
        static["x"][t:] = 1000 * torch.randn_like(static["x"][t:])
        static["positions"][t:] = 4
        static["seq_lens"][t:] = 5
        static["page_table"][t:] = spare
        n.fill_(t)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for k in ("k_cache", "v_cache"):  # no absent row appended
            assert torch.equal(static[k][spare], case[k][spare]), (t, k)
        if t == 0:
            assert torch.isnan(y).all()
            continue
        err = ((y[:t].float().cpu() - want[:t]).norm() / want[:t].norm()).item()
        assert err < 3e-2, (t, err)
        alone = {k: v[:t] for k, v in case.items() if k not in ("k_cache", "v_cache")}
        k2, v2 = case["k_cache"].clone(), case["v_cache"].clone()
        mega(**alone, k_cache=k2, v_cache=v2)
        torch.testing.assert_close(static["k_cache"], k2, rtol=0, atol=2e-2)
        torch.testing.assert_close(static["v_cache"], v2, rtol=0, atol=2e-2)
    mega.check_live(case["k_cache"].shape[0])


def test_op_references_treat_rows_past_the_live_extents_as_absent():
    """The interpreter's references do what the device tiles do when the positions, page
    table and lengths are bound to a live count below the grid's batch: no append and no
    attention tile for the rows past it (the live rows unchanged)."""
    g = decoder_layer_graph(mk.sym("B", max=4), replace(CFG, fused_qkv_tail=False), torch.float32)
    env = {"B": 4, "pages": 6}
    nodes = {n.op.name: n.op for n in g.nodes}
    gen = torch.Generator().manual_seed(1)
    hkv, d, page = CFG.kv_heads, CFG.head_dim, CFG.page_size
    live = 2  # the grid covers 4 sequences, the bound extents 2
    t = {
        "k_new": torch.randn(4, hkv, d, generator=gen),
        "v_new": torch.randn(4, hkv, d, generator=gen),
        "k_cache_out": torch.zeros(6, page, hkv, d),
        "v_cache_out": torch.zeros(6, page, hkv, d),
        "page_table": torch.arange(live * CFG.max_pages, dtype=torch.int32).view(live, -1) % 6,
        "seq_lens": torch.full((live,), 3, dtype=torch.int32),
    }
    t["k_cache"], t["v_cache"] = t["k_cache_out"], t["v_cache_out"]
    append = nodes["kv_append"]
    for b in range(4):
        append.reference((b,), env, t)
    written = t["k_cache_out"].abs().sum(dim=(2, 3)).nonzero().tolist()
    assert len(written) == live  # one slot a live sequence, none for the absent ones
    assert append.writes((3,), env, t) == {"k_cache_out": [], "v_cache_out": []}
    attention = nodes["attention_decode"]
    data = {"seq_lens": t["seq_lens"], "page_table": t["page_table"]}
    assert attention.exists((1, 0), env, data)
    assert not attention.exists((2, 0), env, data) and not attention.exists((3, 0), env, data)
