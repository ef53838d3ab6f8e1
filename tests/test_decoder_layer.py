"""A decode step of a Qwen3 decoder layer as one graph (``cutemk.layers.decoder_layer_graph``)
against transformers' ``Qwen3DecoderLayer``: for each sequence the HF layer runs the whole
sequence (causal SDPA) and its last token's output is the reference; the graph gets that
token, a paged cache holding the keys and values HF's own projections, norms and rotary give
the earlier tokens, and appends the new token's. CPU: the interpreter in fp32 (race checker
on), both schedulers. GPU: the megakernel in bf16. The sm_90a compiles are in
``test_decoder_compile.py``, the batch as device data in ``test_decoder_live.py``."""

import os
from dataclasses import replace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch
from decoder_cases import (
    CFG,
    GPU_CFG,
    attn_weights,
    case_inputs,
    folded,
    hf_layer,
    hf_moe_layer,
    layer_weights,
    step_case,
)

import cutemk as mk
from cutemk.layers import decoder_layer_graph, decoder_prefill_graph

# K wide enough to split every projection in two: the folded norms run in the reduce tiles
CFG_SPLIT = replace(
    CFG, hidden=256, intermediate=256, head_dim=64, split_k=2, fold_norms=True, attention_align=16
)
LAYERS = {
    "plain": CFG,
    "folded": replace(CFG, fold_norms=True),  # unsplit: weightless rmsnorm nodes
    "folded_split": CFG_SPLIT,
    # the split QKV projection's reduce, qk_norm_rope and kv_append in one phase
    "fused_tail": replace(CFG_SPLIT, fused_qkv_tail=True),
    # the split projection reduced by its own phase, qk_norm_rope appending k and v
    "fused_append": replace(CFG_SPLIT, fused_append=True),
}


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("which", list(LAYERS))
def test_decode_step_matches_hf_layer(scheduler, which):
    pytest.importorskip("transformers")
    cfg = LAYERS[which]
    layer, rotary = hf_layer(cfg)
    g = decoder_layer_graph(mk.sym("B", max=8), cfg)
    norm_nodes = [n.name for n in g.nodes if n.op.name == "rmsnorm"]
    assert (norm_nodes == []) == (cfg.fold_norms and cfg.split_k == 2), norm_nodes
    # fused: qk_norm_rope appends k and v itself (with the tail, from the split QKV
    # projection's partials: no reduce phase either)
    names = {n.op.name for n in g.nodes}
    assert ("kv_append" in names) == (which not in ("fused_tail", "fused_append")), names
    assert ("gemm_split_reduce" in names) == (cfg.split_k == 2), names
    qnr = next(n for n in g.nodes if n.op.name == "qk_norm_rope")
    assert qnr.op.appends == (which in ("fused_tail", "fused_append"))
    if which == "folded_split":  # the MLP's norm comes from o_proj's sums of squares
        gu = next(n for n in g.nodes if n.name == "gate_up_sum")
        assert gu.op.norm_width == cfg.hidden and gu.op.x.shape[1] == -(-cfg.hidden // 512)
    c = g.compile("interpret", num_sms=8, scheduler=scheduler)
    w = layer_weights(layer, cfg)
    if cfg.fold_norms:
        w = folded(w)
    gen = torch.Generator().manual_seed(1)
    for lens in ([1], [5, 17], [cfg.page_size * cfg.max_pages, 9, 2]):
        inputs, want = step_case(layer, rotary, cfg, lens, gen)
        y = c(**inputs, **w)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("which", ["plain", "folded_split"])
def test_prefill_step_matches_hf_layer(scheduler, which):
    """A prefill step (``decoder_prefill_graph``): whole prompts, new tokens after a cached
    prefix, one new token, side by side; every new token's output is HF's."""
    pytest.importorskip("transformers")
    cfg = LAYERS[which]
    layer, rotary = hf_layer(cfg)
    g = decoder_prefill_graph(mk.sym("T", max=256), mk.sym("B", max=8), cfg)
    c = g.compile("interpret", num_sms=8, scheduler=scheduler)
    w = layer_weights(layer, cfg)
    if cfg.fold_norms:
        w = folded(w)
    gen = torch.Generator().manual_seed(3)
    for seqs in ([(9, 9)], [(30, 12), (5, 1), (17, 17)]):
        inputs, want = case_inputs(layer, rotary, cfg, seqs, gen)
        y = c(**inputs, **w)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_mega_decoder_layer_from_hf():
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, rotary = hf_layer(CFG)

    def mega_of(max_batch):
        return MegaDecoderLayer.from_hf(
            layer,
            page_size=CFG.page_size,
            max_pages=CFG.max_pages,
            max_positions=256,
            max_batch=max_batch,
            backend="interpret",
        )

    mega = mega_of(18)
    gen = torch.Generator().manual_seed(2)
    # 2 sequences run the graph compiled for at most 8 (the q/k/v tail in one phase), 10 the
    # one for at most 16 (three phases), 17 the one for max_batch
    for lens in ([3, 40], [2 + i for i in range(10)], [1 + i for i in range(17)]):
        inputs, want = step_case(layer, rotary, CFG, lens, gen)
        torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)
    compiled = {k[1]: fn for k, fn in mega._compiled.items()}
    assert sorted(compiled) == ["batch", "gemv", "gemv_tail"]
    appends = {
        r: "kv_append" not in {n.op.name for n in fn.graph.nodes} for r, fn in compiled.items()
    }
    assert appends == {"gemv_tail": True, "gemv": False, "batch": False}
    # warm-up compiles (here: builds) both regimes' graphs by a step of each on its own inputs
    # (a module of another max batch: a key of its own, nothing compiled yet)
    fresh = mega_of(19)
    assert not fresh._compiled
    report = mk.warmup(fresh, progress=False)
    names = [name for name, _ in report.steps]
    assert len(names) == 3, names
    wants = (
        "gemv_tail: {} + launch at T=1",
        "gemv: {} + launch at T=9",
        "batch: {} + launch at T=17",
    )
    for name, want in zip(names, wants):
        # a kernel an earlier process compiled comes from the on-disk cache
        assert name in (want.format("compile"), want.format("load cached kernel")), name
    assert sorted(k[1] for k in fresh._compiled) == ["batch", "gemv", "gemv_tail"]
    with pytest.raises(ValueError, match="page count"):
        mk.warmup(fresh, tokens=[4], progress=False)


def test_mega_decoder_layer_from_hf_takes_config_options():
    """``from_hf(options=...)``: DecoderConfig fields past the HF layer's (here the decode
    step's fused append: no kv_append node); the step still matches HF's layer, and an unknown
    field is refused."""
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, rotary = hf_layer(CFG)
    kw = {"page_size": CFG.page_size, "max_pages": CFG.max_pages, "max_positions": 256}
    mega = MegaDecoderLayer.from_hf(
        layer, **kw, max_batch=4, backend="interpret", options={"fused_append": True}
    )
    assert mega.cfg.fused_append
    inputs, want = step_case(layer, rotary, CFG, [3, 40], torch.Generator().manual_seed(5))
    torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)
    (compiled,) = mega._compiled.values()
    assert "kv_append" not in {n.op.name for n in compiled.graph.nodes}
    with pytest.raises(TypeError, match="no_such_field"):
        MegaDecoderLayer.from_hf(layer, **kw, options={"no_such_field": True})
    for taken in ({"fold_norms": False}, {"hidden": 64}, {"page_size": 8}):
        with pytest.raises(ValueError, match=next(iter(taken))):
            MegaDecoderLayer.from_hf(layer, **kw, options=taken)


def test_from_hf_and_steps_refuse_bad_arguments():
    """What a new user gets wrong, refused with a clear error: option values of the wrong type
    (``"no"`` switched an option on), the MoE block's switches on a dense layer, bad tiles,
    rotary base and table size, something that is not a decoder layer, a biased MLP (its bias
    was dropped), weights that are not a dict of tensors; at a step, caches that share memory
    (both are written in place) and a prefill's row offsets that do not cut x's rows into the
    sequences (rows no sequence covers were never written)."""
    pytest.importorskip("transformers")
    from torch import nn

    from cutemk.nn import MegaDecoderLayer

    layer, rotary = hf_layer(CFG)
    kw = {"page_size": CFG.page_size, "max_pages": CFG.max_pages, "max_positions": 256}
    with pytest.raises(TypeError, match="fused_append must be a bool"):
        MegaDecoderLayer.from_hf(layer, **kw, options={"fused_append": "no"})
    with pytest.raises(ValueError, match="MoE block only"):
        MegaDecoderLayer.from_hf(layer, **kw, options={"moe_router_topk": True})
    with pytest.raises(TypeError, match="options must be a dict"):
        MegaDecoderLayer.from_hf(layer, **kw, options=["fused_append"])
    with pytest.raises(ValueError, match="tiles"):
        MegaDecoderLayer.from_hf(layer, **kw, tiles=(16,))
    for theta in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="rope_theta"):
            MegaDecoderLayer.from_hf(layer, **kw, rope_theta=theta)
    with pytest.raises(ValueError, match="max_positions"):
        MegaDecoderLayer.from_hf(layer, page_size=16, max_positions=-5)
    with pytest.raises(TypeError, match="decoder layer"):
        MegaDecoderLayer.from_hf(None)
    with pytest.raises(TypeError, match="weights must be a dict"):
        MegaDecoderLayer([1, 2], CFG)
    biased = hf_layer(CFG)[0]
    biased.mlp.up_proj = nn.Linear(CFG.hidden, CFG.intermediate, bias=True)
    with pytest.raises(ValueError, match="up_proj.bias"):
        MegaDecoderLayer.from_hf(biased, **kw)

    mega = MegaDecoderLayer.from_hf(
        layer, **kw, max_batch=4, max_prefill_tokens=64, backend="interpret"
    )
    inputs, _ = step_case(layer, rotary, CFG, [3, 40], torch.Generator().manual_seed(5))
    with pytest.raises(mk.errors.LayoutError, match="share memory"):
        mega(**{**inputs, "v_cache": inputs["k_cache"]})
    with pytest.raises(mk.errors.LayoutError, match="share memory"):
        mega(**{**inputs, "v_cache": inputs["k_cache"][1:]})
    pre, _ = case_inputs(layer, rotary, CFG, [(20, 10), (40, 7)], torch.Generator().manual_seed(6))
    for cu in ([0, 10, 15], [0, 12, 10], [1, 10, 17]):  # x has 17 rows
        bad = {**pre, "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}
        with pytest.raises(mk.errors.DataError, match="cu_seqlens must rise from 0"):
            mega(**bad)
    with pytest.raises(mk.errors.ShapeError, match="cu_seqlens must be an int32"):
        mega(**{**pre, "cu_seqlens": pre["cu_seqlens"].long()})


@pytest.mark.parametrize("tail", [None, True, False])
def test_regime_switches_keep_what_the_config_sets(tail):
    """``DECODER_REGIME_CONFIG`` fills only the switches the module's config leaves None: the
    q/k/v tail is one phase up to 8 sequences and three past them unless the config says."""
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, _ = hf_layer(CFG_SPLIT)
    w = folded(layer_weights(layer, CFG_SPLIT))
    cfg = replace(CFG_SPLIT, fused_qkv_tail=tail)
    mega = MegaDecoderLayer(w, cfg, max_batch=12, backend="interpret")
    for regime, fused in (("gemv_tail", True), ("gemv", False)):
        names = {n.name for n in mega.compiled(regime).graph.nodes}
        assert ("qkv_proj_sum" not in names) == (fused if tail is None else tail), names


def test_moe_layer_decodes_on_megamoe_tiles():
    """A MoE layer's sparse block runs, in each decode regime, the tiles MegaMoE runs for the
    regime's largest batch (the router split over K, the down projection 128 columns wide),
    whatever tiles its MoeConfig carries (``from_hf`` gives the dense GEMMs' 64 x 64)."""
    from decoder_cases import QWEN3_30B_DECODE, bare_decoder

    from cutemk.layers import MoeConfig
    from cutemk.nn import MOE_REGIME_LIMITS
    from cutemk.regimes import DECODER_MOE_REGIME_LIMITS, moe_tiles, regime_of

    # a hand-built block's own tile fields (the slot layout even) are not what decodes
    moe = MoeConfig(
        2048, 768, 128, 8, router_dtype=None, block_m=64, block_n=64, slots=True, route_chunk=8
    )
    mega = bare_decoder(QWEN3_30B_DECODE, moe)
    seen = []
    for regime, _ in mega.decode_regime_starts():
        limit = min(mega.max_batch, DECODER_MOE_REGIME_LIMITS[regime] or mega.max_batch)
        block = regime_of(MOE_REGIME_LIMITS, limit)
        want = moe_tiles(block, 2048, "cute", torch.bfloat16, intermediate=768, top_k=8)
        nodes = {n.name: n.op for n in mega.regime_graph(regime, torch.bfloat16).nodes}
        assert nodes["router"].split_k == want["router_split"] > 1, regime
        # the slots regime's router runs the top-k in its last tile: one block of 128 experts
        router_n = 128 if want.get("router_topk") else want["router_block_n"]
        assert nodes["router"].block_n == router_n, regime
        assert ("topk_softmax0" in nodes) != bool(want.get("router_topk")), regime
        assert nodes["experts_down"].block_n == want["down_block_n"] == 128, regime
        assert nodes["experts_gate_up"].block_n == want["block_n"], regime
        assert ("moe_route0" in nodes) == (not want["slots"]), regime
        assert "moe_route_count0" not in nodes, regime  # no routing over SMs below 512
        # DECODER_MOE_CONFIG: o_proj's reduce writes the block's norm, the combine adds the
        # residual: no mlp_norm phase and no add phase in any decode regime
        assert "mlp_norm" not in nodes and "residual" not in nodes, (regime, sorted(nodes))
        seen.append(block)
    assert seen == ["slots", "gemv", "decode"]
    # one token's 8 experts x 768 columns: 128 gate/up tiles of 48 for the 132 SMs; on 66
    # SMs 64 tiles of 96 (one wave) stream as many columns an SM as two waves of 48
    fit = {"intermediate": 768, "top_k": 8}
    assert moe_tiles("slots", 2048, **fit)["block_n"] == 48
    assert moe_tiles("slots", 2048, **fit, num_sms=66)["block_n"] == 96
    assert moe_tiles("slots", 2048)["block_n"] == 64  # sizes not given


def test_moe_layer_keeps_norm_and_add_phases_when_told():
    """The MoE decode regimes' ``DECODER_MOE_CONFIG`` switches follow the module's config only
    where it leaves them None: explicit False keeps the mlp_norm and residual phases."""
    from decoder_cases import QWEN3_30B_DECODE, bare_decoder

    from cutemk.layers import MoeConfig

    moe = MoeConfig(2048, 768, 128, 8, router_dtype=None)
    cfg = replace(QWEN3_30B_DECODE, post_norm_in_reduce=False, moe_residual_in_combine=False)
    mega = bare_decoder(cfg, moe)
    for regime, _ in mega.decode_regime_starts():
        nodes = {n.name for n in mega.regime_graph(regime, torch.bfloat16).nodes}
        assert "mlp_norm" in nodes and "residual" in nodes, (regime, sorted(nodes))
    g = mega.regime_graph("slots", torch.bfloat16, num_sms=66)
    assert next(n.op for n in g.nodes if n.name == "experts_gate_up").block_n == 96


def test_mega_decoder_layer_prefill_from_hf():
    """``MegaDecoderLayer.forward(..., cu_seqlens=)``: a prefill step matches HF's layer; a
    module built without ``max_prefill_tokens`` refuses it, and so does a step past it."""
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, rotary = hf_layer(CFG)
    kw = {"page_size": CFG.page_size, "max_pages": CFG.max_pages, "max_positions": 256}
    mega = MegaDecoderLayer.from_hf(
        layer, **kw, max_batch=4, max_prefill_tokens=64, backend="interpret"
    )
    gen = torch.Generator().manual_seed(4)
    inputs, want = case_inputs(layer, rotary, CFG, [(20, 20), (40, 7)], gen)
    torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)
    assert "prefill" in mega.regimes()
    decode_only = MegaDecoderLayer.from_hf(layer, **kw, max_batch=4, backend="interpret")
    with pytest.raises(mk.CuteMKError, match="max_prefill_tokens"):
        decode_only(**inputs)
    big, _ = case_inputs(layer, rotary, CFG, [(70, 65)], gen)
    with pytest.raises(mk.errors.ShapeError, match="max_prefill_tokens=64"):
        mega(**big)
    with pytest.raises(ValueError, match="prefill_tiles"):
        MegaDecoderLayer.from_hf(layer, **kw, max_prefill_tokens=8, prefill_tiles=(16,))
    # warm-up runs a step of every regime, the prefill one included
    fresh = MegaDecoderLayer.from_hf(
        layer, **kw, max_batch=3, max_prefill_tokens=32, backend="interpret"
    )
    names = [name for name, _ in mk.warmup(fresh, progress=False).steps]
    assert any(n.startswith("prefill: ") for n in names), names
    assert "prefill" in {k[1] for k in fresh._compiled}


def _gpu_step_err(mega, inputs, want) -> float:
    """A decode step of ``mega`` on the GPU (x and the caches in bf16) against HF's output."""
    cuda = {k: v.cuda() for k, v in inputs.items()}
    for k in ("x", "k_cache", "v_cache"):
        cuda[k] = cuda[k].bfloat16()
    y = mega(**cuda)
    return ((y.float().cpu() - want).norm() / want.norm()).item()


_TAILS = {  # MegaDecoderLayer's choice per regime (3 sequences: one phase), or forced
    "regime": {},
    "three_phases": {"fused_qkv_tail": False},
    "fused_append": {"fused_qkv_tail": False, "fused_append": True},
    "o_proj_l2_prefetch": {"o_proj_l2_prefetch": True},  # the prefetch changes no result
}


@pytest.mark.gpu
@pytest.mark.parametrize("tail", list(_TAILS))
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_mega_decoder_layer_on_the_gpu(scheduler, tail):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    cfg = GPU_CFG
    layer, rotary = hf_layer(cfg)
    gen = torch.Generator().manual_seed(3)
    inputs, want = step_case(layer, rotary, cfg, [1, 77, 1024], gen)
    mega = MegaDecoderLayer.from_hf(
        layer.to(torch.bfloat16),
        page_size=16,
        max_pages=64,
        max_positions=2048,
        scheduler=scheduler,
        options=_TAILS[tail],
    ).cuda()
    err = _gpu_step_err(mega, inputs, want)
    assert err < 3e-2, err


def _moe_mega(layer, cfg, **options):
    """``MegaDecoderLayer.from_hf`` of a small Qwen3-MoE layer on the interpreter: up to 8
    sequences a decode step (regimes slots and gemv), prefill steps of up to 96 tokens."""
    from cutemk.nn import MegaDecoderLayer

    return MegaDecoderLayer.from_hf(
        layer,
        page_size=cfg.page_size,
        max_pages=cfg.max_pages,
        max_positions=256,
        tiles=(16, 32),
        max_batch=8,
        max_prefill_tokens=96,
        backend="interpret",
        options=options or None,
    )


def test_moe_decode_step_matches_hf_layer():
    """The same decode step with the sparse MoE block (Qwen3MoeDecoderLayer)."""
    pytest.importorskip("transformers")
    from cutemk.layers import MoeConfig

    e, k, inter = 8, 2, 32
    layer, rotary = hf_moe_layer(CFG, e, k, inter)
    moe = MoeConfig(CFG.hidden, inter, e, k, block_m=16, block_n=32, router_dtype=None)
    c = decoder_layer_graph(mk.sym("B", max=8), CFG, moe=moe).compile("interpret", num_sms=8)
    block = layer.mlp
    w = attn_weights(layer, CFG)
    experts = block.experts
    w.update(
        w_router=block.gate.weight.detach(),
        w_gate_up=experts.gate_up_proj.detach(),
        w_down=experts.down_proj.detach(),
    )
    gen = torch.Generator().manual_seed(5)
    for lens in ([2], [9, 33, 1]):
        inputs, want = step_case(layer, rotary, CFG, lens, gen)
        torch.testing.assert_close(c(**inputs, **w), want, rtol=1e-4, atol=1e-4)
    mega = _moe_mega(layer, CFG)
    assert mega.regimes() == ("slots", "gemv", "prefill")
    # the attention weights are copies, the experts are MegaMoE.from_hf's (not copied: most of
    # a layer's memory, where a copy doubled it while the HF model is alive)
    same = lambda a, b: a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # noqa: E731
    assert same(mega.w_gate_up, experts.gate_up_proj) and same(mega.w_down, experts.down_proj)
    assert not same(mega.w_o, layer.self_attn.o_proj.weight)
    for lens in ([7], [4, 12], [3, 9, 20]):  # slots (no routing step), slots, gemv
        inputs, want = step_case(layer, rotary, CFG, lens, gen)
        torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)
    names = {n.op.name for n in mega.compiled("slots").graph.nodes}
    assert "moe_grouped_gemm" in names and "moe_route" not in names, names
    assert "kv_append" not in names, names  # the q/k/v tail one phase (DECODER_REGIME_CONFIG)
    assert "kv_append" in {n.op.name for n in mega.compiled("gemv").graph.nodes}
    # a prefill step of the same module: MegaMoE's prefill routing (chunks over SMs)
    inputs, want = case_inputs(layer, rotary, CFG, [(40, 40), (50, 21), (3, 1)], gen)
    torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_decode_step_with_the_norm_in_o_proj_reduce(scheduler):
    """``post_norm_in_reduce``: o_proj's split reduce also writes the MoE block's normalised
    rows (whole rows a tile), so the step has no mlp_norm phase; ``moe_residual_in_combine``:
    the combine adds the residual, so it has no add phase either. It matches HF's layer."""
    pytest.importorskip("transformers")
    from cutemk.layers import MoeConfig

    e, k, inter = 8, 2, 32
    cfg = replace(
        CFG_SPLIT, fold_norms=False, post_norm_in_reduce=True, moe_residual_in_combine=True
    )
    layer, rotary = hf_moe_layer(cfg, e, k, inter)
    moe = MoeConfig(cfg.hidden, inter, e, k, block_m=16, block_n=32, router_dtype=None)
    g = decoder_layer_graph(mk.sym("B", max=8), cfg, moe=moe)
    assert not {"mlp_norm", "residual"} & {n.name for n in g.nodes}
    assert "r" in next(n for n in g.nodes if n.op.name == "moe_combine").args
    red = next(n for n in g.nodes if n.name == "o_proj_sum")
    assert red.op.out_norm is not None and red.op.block_n >= cfg.hidden and red.op.block_m == 1
    router = next(n for n in g.nodes if n.name == "router")
    assert router.args["a"].producer is red  # the router reads the reduce's normalised rows
    c = g.compile("interpret", num_sms=8, scheduler=scheduler)
    block = layer.mlp
    w = attn_weights(layer, cfg)
    w.update(
        w_router=block.gate.weight.detach(),
        w_gate_up=block.experts.gate_up_proj.detach(),
        w_down=block.experts.down_proj.detach(),
    )
    gen = torch.Generator().manual_seed(6)
    for lens in ([2], [9, 33, 1]):
        inputs, want = step_case(layer, rotary, cfg, lens, gen)
        torch.testing.assert_close(c(**inputs, **w), want, rtol=1e-4, atol=1e-4)
    # prefill graphs keep the norm phase (their o_proj is not split)
    pg = decoder_prefill_graph(mk.sym("T", max=64), mk.sym("B", max=4), cfg, moe=moe)
    assert "mlp_norm" in {n.name for n in pg.nodes}
    # the module with both switches in every regime: the slots regime's combine in the down
    # tiles adds the residual there
    switches = {"post_norm_in_reduce": True, "moe_residual_in_combine": True, "split_k": 2}
    mega = _moe_mega(layer, cfg, **switches)
    for lens in ([7], [4, 12], [3, 9, 20]):  # slots, slots, gemv
        inputs, want = step_case(layer, rotary, cfg, lens, gen)
        torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)
    slots = mega.compiled("slots").graph
    down = next(n for n in slots.nodes if n.name == "experts_down")
    assert down.op.residual is not None and "residual" not in {n.name for n in slots.nodes}
    inputs, want = case_inputs(layer, rotary, cfg, [(40, 40), (50, 21), (3, 1)], gen)
    torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_mega_decoder_layer_prefill_on_the_gpu(scheduler):
    """A prefill step of the layer as one megakernel on the GPU (bf16) against HF's layer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    cfg = replace(CFG, hidden=256, intermediate=512, heads=8, kv_heads=2, head_dim=64)
    layer, rotary = hf_layer(cfg)
    mega = MegaDecoderLayer.from_hf(
        layer.to(torch.bfloat16).cuda(),
        page_size=cfg.page_size,
        max_pages=cfg.max_pages,
        max_positions=256,
        max_batch=4,
        max_prefill_tokens=128,
        scheduler=scheduler,
    )
    gen = torch.Generator().manual_seed(5)
    inputs, want = case_inputs(layer.float().cpu(), rotary, cfg, [(64, 64), (100, 30), (9, 1)], gen)
    args = {
        k: (v.cuda().bfloat16() if v.is_floating_point() else v.cuda()) for k, v in inputs.items()
    }
    y = mega(**args).float().cpu()
    err = ((y - want).norm() / want.norm()).item()
    assert err < 3e-2, err


_MOE_ENDS = {  # the norm and the residual add as phases, or in o_proj's reduce and the combine
    "phases": {},
    "fused_ends": {"post_norm_in_reduce": True, "moe_residual_in_combine": True},
}


@pytest.mark.gpu
@pytest.mark.parametrize("ends", list(_MOE_ENDS))
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_mega_moe_decoder_layer_on_the_gpu(scheduler, ends):
    """A Qwen3-MoE decoder layer's decode steps on the GPU (bf16) against HF's layer: one and
    two sequences run the 'slots' regime (the sparse block without a routing step), three the
    'gemv' one; ``fused_ends``: the MLP's norm written by o_proj's reduce, the residual added
    by the combine (in the down tiles in 'slots')."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    cfg = replace(GPU_CFG, intermediate=256)
    layer, rotary = hf_moe_layer(cfg, 8, 2, 256)
    mega = MegaDecoderLayer.from_hf(
        layer.to(torch.bfloat16),
        page_size=16,
        max_pages=64,
        max_positions=2048,
        max_batch=8,
        scheduler=scheduler,
        options=_MOE_ENDS[ends],
    ).cuda()
    assert mega.regimes() == ("slots", "gemv")
    layer.float()
    gen = torch.Generator().manual_seed(4)
    for lens in ([300], [1, 77], [5, 1024, 9]):
        inputs, want = step_case(layer, rotary, cfg, lens, gen)
        err = _gpu_step_err(mega, inputs, want)
        assert err < 3e-2, (lens, err)


def test_layer_refuses_weights_it_does_not_take():
    """``MegaDecoderLayer`` built directly: its weights are exactly its decode graph's (a
    missing one used to surface at the first call as a KeyError, an extra one as a clash with
    a call argument or a module attribute), and ``prefill_tiles`` is a pair."""
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, _ = hf_layer(CFG_SPLIT)
    w = folded(layer_weights(layer, CFG_SPLIT))
    MegaDecoderLayer(w, CFG_SPLIT, max_batch=4, backend="interpret")
    less = {k: v for k, v in w.items() if k != "w_down"}
    with pytest.raises(ValueError, match=r"missing \['w_down'\], unexpected \[\]"):
        MegaDecoderLayer(less, CFG_SPLIT, max_batch=4, backend="interpret")
    for extra in ("x", "cfg", "forward"):
        with pytest.raises(ValueError, match=rf"missing \[\], unexpected \['{extra}'\]"):
            MegaDecoderLayer({**w, extra: w["w_down"]}, CFG_SPLIT, max_batch=4, backend="interpret")
    with pytest.raises(ValueError, match="prefill_tiles must be"):
        MegaDecoderLayer(w, CFG_SPLIT, max_prefill_tokens=8, prefill_tiles=5, backend="interpret")


def test_cast_layer_keeps_its_rotary_table_and_from_hf_copies_the_weights():
    """``.to(torch.bfloat16)`` casts the weights and moves the fp32 rotary table without
    casting it (the cast table was refused at the first call); ``from_hf`` copies every weight
    as it says (``w_o``, ``q_norm``, ``k_norm``, ``w_down`` shared the HF layer's memory, so
    loading a state dict into the module rewrote the HF layer and every module built from it)."""
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, rotary = hf_layer(CFG)
    kw = {"page_size": CFG.page_size, "max_pages": CFG.max_pages, "max_positions": 256}
    inputs, want = step_case(layer, rotary, CFG, [3, 40], torch.Generator().manual_seed(5))
    mega = MegaDecoderLayer.from_hf(layer, **kw, max_batch=4, backend="interpret")
    before = {n: p.clone() for n, p in layer.state_dict().items()}
    mega.load_state_dict({n: torch.zeros_like(w) for n, w in mega.state_dict().items()})
    for n, p in layer.state_dict().items():
        assert torch.equal(p, before[n]), n
    half = MegaDecoderLayer.from_hf(layer, **kw, max_batch=4, backend="interpret")
    half.to(torch.bfloat16)
    assert half.cos_sin.dtype == torch.float32 and half.w_o.dtype == torch.bfloat16
    bf = {k: v.bfloat16() if v.is_floating_point() else v for k, v in inputs.items()}
    torch.testing.assert_close(half(**bf).float(), want, rtol=5e-2, atol=5e-2)


def test_steps_name_bad_inputs_and_take_an_empty_batch():
    """A step's x or prefill lengths that are not tensors are named (an AttributeError from
    deep inside before), a batch of no sequences returns no rows (as a live count of 0 runs
    nothing; it was 'tokens must be a positive int'), and a layer without Qwen3's q/k norms
    (Llama's) is refused by name (an AttributeError)."""
    transformers = pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, rotary = hf_layer(CFG)
    kw = {"page_size": CFG.page_size, "max_pages": CFG.max_pages, "max_positions": 256}
    mega = MegaDecoderLayer.from_hf(
        layer, **kw, max_batch=4, max_prefill_tokens=64, backend="interpret"
    )
    inputs, _ = step_case(layer, rotary, CFG, [3, 40], torch.Generator().manual_seed(5))
    for bad in (None, inputs["x"].tolist()):
        with pytest.raises(TypeError, match="x must be a torch.Tensor"):
            mega(**{**inputs, "x": bad})
    pre, _ = case_inputs(layer, rotary, CFG, [(20, 10), (40, 7)], torch.Generator().manual_seed(6))
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor"):
        mega(**{**pre, "seq_lens": [20, 40]})
    k_cache = inputs["k_cache"].clone()
    empty = {
        "x": inputs["x"][:0],
        "positions": inputs["positions"][:0],
        "page_table": inputs["page_table"][:0],
        "seq_lens": inputs["seq_lens"][:0],
    }
    y = mega(**{**inputs, **empty})
    assert y.shape == (0, CFG.hidden) and torch.equal(inputs["k_cache"], k_cache)
    llama_cfg = transformers.LlamaConfig(
        hidden_size=CFG.hidden,
        intermediate_size=CFG.intermediate,
        num_attention_heads=CFG.heads,
        num_key_value_heads=CFG.kv_heads,
        head_dim=CFG.head_dim,
        max_position_embeddings=256,
    )
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    with pytest.raises(ValueError, match="LlamaAttention has no q_norm"):
        MegaDecoderLayer.from_hf(LlamaDecoderLayer(llama_cfg, 0), **kw)


def test_the_layer_op_checks_its_rows_and_weights_traced_and_real():
    """``torch.ops.cutemk.mega_decoder_layer`` with rows or weights of the wrong shape: a
    clear error from its fake (meta) implementation where it is traced, and from the real
    call, instead of an output shaped like whatever came in."""
    pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cutemk import torch_ops
    from cutemk.errors import LayoutError
    from cutemk.nn import MegaDecoderLayer

    layer, _ = hf_layer(CFG_SPLIT)
    mega = MegaDecoderLayer(
        folded(layer_weights(layer, CFG_SPLIT)), CFG_SPLIT, max_batch=4, backend="interpret"
    )
    key = torch_ops.key_of(mega)
    weights = list(mega._leaf_weights())
    h = CFG_SPLIT.hidden
    for mode in (FakeTensorMode(), None):
        conv = mode.from_tensor if mode is not None else (lambda t: t)

        def call(x, ws):
            caches = torch.zeros(8, 16, CFG_SPLIT.kv_heads, CFG_SPLIT.head_dim)
            rows = x.shape[0]
            return torch.ops.cutemk.mega_decoder_layer(
                conv(x),
                conv(torch.zeros(rows, dtype=torch.int32)),
                conv(caches),
                conv(caches.clone()),
                conv(torch.zeros(rows, CFG_SPLIT.max_pages, dtype=torch.int32)),
                conv(torch.ones(rows, dtype=torch.int32)),
                [conv(w) for w in ws],
                key,
            )

        with mode if mode is not None else torch.no_grad():
            with pytest.raises(LayoutError, match=r"T <= max_batch=4"):
                call(torch.randn(5, h), weights)
            with pytest.raises(LayoutError, match=rf"\(T, {h}\)"):
                call(torch.randn(2, h + 1), weights)
            with pytest.raises(LayoutError, match="takes its"):
                call(torch.randn(2, h), weights[:-1])
