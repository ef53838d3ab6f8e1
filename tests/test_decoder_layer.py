"""A decode step of a Qwen3 decoder layer as one graph (``cutemk.layers.decoder_layer_graph``)
against transformers' ``Qwen3DecoderLayer``: for each sequence the HF layer runs the whole
sequence (causal SDPA) and its last token's output is the reference; the graph gets that
token, a paged cache holding the keys and values HF's own projections, norms and rotary give
the earlier tokens, and appends the new token's. CPU: the interpreter in fp32 (race checker
on), both schedulers, and a compile of the layer for sm_90a at Qwen3-8B's size."""

import os
from dataclasses import replace

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.layers import DecoderConfig, decoder_layer_graph, decoder_prefill_graph, fold_norm
from cutemk.runtime import compile_offline

CFG = DecoderConfig(
    hidden=64,
    intermediate=96,
    heads=4,
    kv_heads=2,
    head_dim=32,
    page_size=8,
    max_pages=16,
    max_positions=256,
    block_m=16,
    block_n=32,
    attention_align=16,
)


def _hf(cfg: DecoderConfig):
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    hf_cfg = Qwen3Config(
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.eps,
        rope_theta=1_000_000.0,
        max_position_embeddings=cfg.max_positions,
    )
    return _randomized(Qwen3DecoderLayer, hf_cfg, 0), Qwen3RotaryEmbedding(hf_cfg)


def _randomized(layer_cls, hf_cfg, seed: int):
    """An HF layer (SDPA attention) with random weights: norms near 1, others ~1/sqrt(fan-in)."""
    hf_cfg._attn_implementation = "sdpa"
    layer = layer_cls(hf_cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return layer


def _attn_weights(layer, cfg):
    a = layer.self_attn
    return {
        "input_norm": layer.input_layernorm.weight.detach(),
        "w_qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
        "q_norm": a.q_norm.weight.detach(),
        "k_norm": a.k_norm.weight.detach(),
        "cos_sin": ops.rope_table(cfg.max_positions, cfg.head_dim),
        "w_o": a.o_proj.weight.detach(),
        "post_norm": layer.post_attention_layernorm.weight.detach(),
    }


def _weights(layer, cfg):
    m = layer.mlp
    return {
        **_attn_weights(layer, cfg),
        "w_gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
        "w_down": m.down_proj.weight.detach(),
    }


def _step_case(layer, rotary, cfg, lens, gen):
    """Graph inputs for one decode step over sequences of ``lens`` tokens (the last one new),
    and HF's output for each sequence's last token."""
    inputs, want = _case(layer, rotary, cfg, [(n, 1) for n in lens], gen)
    del inputs["cu_seqlens"]
    return inputs, want


def _case(layer, rotary, cfg, seqs, gen):
    """Graph inputs for one step over sequences of ``(length, new)`` tokens (the last ``new``
    of each new, side by side in x), and HF's output for the new tokens."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    a, hkv, d, page = layer.self_attn, cfg.kv_heads, cfg.head_dim, cfg.page_size
    pages = [-(-n // page) for n, _ in seqs]
    total = sum(pages) + 1
    perm = torch.randperm(total, generator=gen).tolist()
    k_cache = torch.randn(total, page, hkv, d, generator=gen)  # garbage outside the sequences
    v_cache = torch.randn(total, page, hkv, d, generator=gen)
    table = torch.zeros(len(seqs), cfg.max_pages, dtype=torch.int32)
    xs, want, positions, i = [], [], [], 0
    with torch.no_grad():
        for b, (n, new) in enumerate(seqs):
            table[b, : pages[b]] = torch.tensor(perm[i : i + pages[b]], dtype=torch.int32)
            i += pages[b]
            x = torch.randn(1, n, cfg.hidden, generator=gen)
            pos = torch.arange(n)[None]
            cos, sin = rotary(x, pos)
            want.append(layer(x, position_ids=pos, position_embeddings=(cos, sin))[0, n - new :])
            xs.append(x[0, n - new :])
            positions += list(range(n - new, n))
            old = n - new
            if old:  # the earlier tokens' keys and values, as HF's attention makes them
                hn = layer.input_layernorm(x[:, :old])
                k = a.k_norm(a.k_proj(hn).view(1, old, hkv, d)).transpose(1, 2)
                v = a.v_proj(hn).view(1, old, hkv, d)
                _, k = apply_rotary_pos_emb(k, k, cos[:, :old], sin[:, :old])
                k = k.transpose(1, 2)[0]
                for p_ in range(old):
                    pg, slot = int(table[b, p_ // page]), p_ % page
                    k_cache[pg, slot], v_cache[pg, slot] = k[p_], v[0, p_]
    cu = [0]
    for _, new in seqs:
        cu.append(cu[-1] + new)
    inputs = {
        "x": torch.cat(xs),
        "positions": torch.tensor(positions, dtype=torch.int32),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "page_table": table,
        "seq_lens": torch.tensor([n for n, _ in seqs], dtype=torch.int32),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
    }
    return inputs, torch.cat(want)


def _folded(w):
    """The weights with the RMSNorm weights folded into the projections (``fold_norms``)."""
    w = dict(w)
    w["w_qkv"] = fold_norm(w["w_qkv"], w.pop("input_norm"))
    w["w_gate_up"] = fold_norm(w["w_gate_up"], w.pop("post_norm"))
    return w


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
    layer, rotary = _hf(cfg)
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
    w = _weights(layer, cfg)
    if cfg.fold_norms:
        w = _folded(w)
    gen = torch.Generator().manual_seed(1)
    for lens in ([1], [5, 17], [cfg.page_size * cfg.max_pages, 9, 2]):
        inputs, want = _step_case(layer, rotary, cfg, lens, gen)
        y = c(**inputs, **w)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("which", ["plain", "folded_split"])
def test_prefill_step_matches_hf_layer(scheduler, which):
    """A prefill step (``decoder_prefill_graph``): whole prompts, new tokens after a cached
    prefix, one new token, side by side; every new token's output is HF's."""
    pytest.importorskip("transformers")
    cfg = LAYERS[which]
    layer, rotary = _hf(cfg)
    g = decoder_prefill_graph(mk.sym("T", max=256), mk.sym("B", max=8), cfg)
    c = g.compile("interpret", num_sms=8, scheduler=scheduler)
    w = _weights(layer, cfg)
    if cfg.fold_norms:
        w = _folded(w)
    gen = torch.Generator().manual_seed(3)
    for seqs in ([(9, 9)], [(30, 12), (5, 1), (17, 17)]):
        inputs, want = _case(layer, rotary, cfg, seqs, gen)
        y = c(**inputs, **w)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


def test_mega_decoder_layer_from_hf():
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, rotary = _hf(CFG)

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
        inputs, want = _step_case(layer, rotary, CFG, lens, gen)
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

    layer, rotary = _hf(CFG)
    kw = {"page_size": CFG.page_size, "max_pages": CFG.max_pages, "max_positions": 256}
    mega = MegaDecoderLayer.from_hf(
        layer, **kw, max_batch=4, backend="interpret", options={"fused_append": True}
    )
    assert mega.cfg.fused_append
    inputs, want = _step_case(layer, rotary, CFG, [3, 40], torch.Generator().manual_seed(5))
    torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)
    (compiled,) = mega._compiled.values()
    assert "kv_append" not in {n.op.name for n in compiled.graph.nodes}
    with pytest.raises(TypeError, match="no_such_field"):
        MegaDecoderLayer.from_hf(layer, **kw, options={"no_such_field": True})
    for taken in ({"fold_norms": False}, {"hidden": 64}, {"page_size": 8}):
        with pytest.raises(ValueError, match=next(iter(taken))):
            MegaDecoderLayer.from_hf(layer, **kw, options=taken)


@pytest.mark.parametrize("tail", [None, True, False])
def test_regime_switches_keep_what_the_config_sets(tail):
    """``DECODER_REGIME_CONFIG`` fills only the switches the module's config leaves None: the
    q/k/v tail is one phase up to 8 sequences and three past them unless the config says."""
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, _ = _hf(CFG_SPLIT)
    w = _folded(_weights(layer, CFG_SPLIT))
    cfg = replace(CFG_SPLIT, fused_qkv_tail=tail)
    mega = MegaDecoderLayer(w, cfg, max_batch=12, backend="interpret")
    for regime, fused in (("gemv_tail", True), ("gemv", False)):
        names = {n.name for n in mega.compiled(regime).graph.nodes}
        assert ("qkv_proj_sum" not in names) == (fused if tail is None else tail), names


def test_mega_decoder_layer_prefill_from_hf():
    """``MegaDecoderLayer.forward(..., cu_seqlens=)``: a prefill step matches HF's layer; a
    module built without ``max_prefill_tokens`` refuses it, and so does a step past it."""
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    layer, rotary = _hf(CFG)
    kw = dict(page_size=CFG.page_size, max_pages=CFG.max_pages, max_positions=256)
    mega = MegaDecoderLayer.from_hf(
        layer, **kw, max_batch=4, max_prefill_tokens=64, backend="interpret"
    )
    gen = torch.Generator().manual_seed(4)
    inputs, want = _case(layer, rotary, CFG, [(20, 20), (40, 7)], gen)
    torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)
    assert "prefill" in mega.regimes()
    decode_only = MegaDecoderLayer.from_hf(layer, **kw, max_batch=4, backend="interpret")
    with pytest.raises(mk.CuteMKError, match="max_prefill_tokens"):
        decode_only(**inputs)
    big, _ = _case(layer, rotary, CFG, [(70, 65)], gen)
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


# a small layer for the GPU tests: 512 wide, 8 / 2 heads of 128, 16-token pages
_GPU_CFG = DecoderConfig(
    hidden=512,
    intermediate=1024,
    heads=8,
    kv_heads=2,
    head_dim=128,
    page_size=16,
    max_pages=64,
    max_positions=2048,
)


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

    cfg = _GPU_CFG
    layer, rotary = _hf(cfg)
    gen = torch.Generator().manual_seed(3)
    inputs, want = _step_case(layer, rotary, cfg, [1, 77, 1024], gen)
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


def _hf_moe(cfg: DecoderConfig, experts: int, top_k: int, inter: int):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeRotaryEmbedding,
    )

    hf_cfg = Qwen3MoeConfig(
        hidden_size=cfg.hidden,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.eps,
        rope_theta=1_000_000.0,
        max_position_embeddings=cfg.max_positions,
    )
    return _randomized(Qwen3MoeDecoderLayer, hf_cfg, 4), Qwen3MoeRotaryEmbedding(hf_cfg)


def test_moe_decode_step_matches_hf_layer():
    """The same decode step with the sparse MoE block (Qwen3MoeDecoderLayer)."""
    pytest.importorskip("transformers")
    from cutemk.layers import MoeConfig

    e, k, inter = 8, 2, 32
    layer, rotary = _hf_moe(CFG, e, k, inter)
    moe = MoeConfig(CFG.hidden, inter, e, k, block_m=16, block_n=32, router_dtype=None)
    c = decoder_layer_graph(mk.sym("B", max=8), CFG, moe=moe).compile("interpret", num_sms=8)
    block = layer.mlp
    w = _attn_weights(layer, CFG)
    experts = block.experts
    w.update(
        w_router=block.gate.weight.detach(),
        w_gate_up=experts.gate_up_proj.detach(),
        w_down=experts.down_proj.detach(),
    )
    gen = torch.Generator().manual_seed(5)
    for lens in ([2], [9, 33, 1]):
        inputs, want = _step_case(layer, rotary, CFG, lens, gen)
        torch.testing.assert_close(c(**inputs, **w), want, rtol=1e-4, atol=1e-4)
    from cutemk.nn import MegaDecoderLayer

    mega = MegaDecoderLayer.from_hf(
        layer,
        page_size=CFG.page_size,
        max_pages=CFG.max_pages,
        max_positions=256,
        tiles=(16, 32),
        max_batch=8,
        max_prefill_tokens=96,
        backend="interpret",
    )
    assert mega.regimes() == ("slots", "gemv", "prefill")
    for lens in ([7], [4, 12], [3, 9, 20]):  # slots (no routing step), slots, gemv
        inputs, want = _step_case(layer, rotary, CFG, lens, gen)
        torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)
    names = {n.op.name for n in mega.compiled("slots").graph.nodes}
    assert "moe_grouped_gemm" in names and "moe_route" not in names, names
    # a prefill step of the same module: MegaMoE's prefill routing (chunks over SMs)
    inputs, want = _case(layer, rotary, CFG, [(40, 40), (50, 21), (3, 1)], gen)
    torch.testing.assert_close(mega(**inputs), want, rtol=1e-4, atol=1e-4)


_QWEN3_8B_DECODE = DecoderConfig(
    hidden=4096,
    intermediate=12288,
    heads=32,
    kv_heads=8,
    head_dim=128,
    max_pages=512,
    block_m=64,
    block_n=64,
    fold_norms=True,
)
"""Qwen3-8B's decode layer as the compile checks build it (64 x 64 GEMM tiles, norms folded)."""


# Qwen3-30B-A3B's attention and hidden sizes (its sparse block given as a MoeConfig)
_QWEN3_30B_DECODE = DecoderConfig(
    hidden=2048,
    intermediate=768,
    heads=32,
    kv_heads=4,
    head_dim=128,
    max_pages=512,
    block_m=64,
    block_n=64,
)


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
        cfg = _QWEN3_8B_DECODE
    else:
        cfg = _QWEN3_30B_DECODE
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
    g = decoder_layer_graph(mk.sym("B", max=16), _QWEN3_8B_DECODE, torch.bfloat16)
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
    g = decoder_layer_graph(mk.sym("B", max=16), _QWEN3_8B_DECODE, torch.bfloat16)
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
        cfg = replace(_QWEN3_8B_DECODE, o_proj_l2_prefetch=on)
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
    cfg = replace(_QWEN3_8B_DECODE, **{fused: True})
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
    cfg = replace(_QWEN3_8B_DECODE, fused_reduce=True)
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


def test_prefill_layer_compiles_for_hopper(tmp_path):
    """Qwen3-8B's prefill step (``decoder_prefill_graph``) as one kernel for sm_90a: the
    projections on the Hopper GEMM, the append and the causal attention on the tensor cores.
    (Register spills of this kernel: see benchmarks/NOTES.md.)"""
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
    g = decoder_prefill_graph(mk.sym("T", max=8192), mk.sym("B", max=64), cfg, torch.bfloat16)
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    ptx = ptx_file.read_text()
    assert "wgmma.mma_async" in ptx
    # the attention's S = q K^T (the projections' tiles are 128 wide)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
    assert "mma.sync" not in ptx


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_mega_decoder_layer_prefill_on_the_gpu(scheduler):
    """A prefill step of the layer as one megakernel on the GPU (bf16) against HF's layer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    cfg = replace(CFG, hidden=256, intermediate=512, heads=8, kv_heads=2, head_dim=64)
    layer, rotary = _hf(cfg)
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
    inputs, want = _case(layer.float().cpu(), rotary, cfg, [(64, 64), (100, 30), (9, 1)], gen)
    args = {
        k: (v.cuda().bfloat16() if v.is_floating_point() else v.cuda()) for k, v in inputs.items()
    }
    y = mega(**args).float().cpu()
    err = ((y - want).norm() / want.norm()).item()
    assert err < 3e-2, err


def test_moe_decode_layer_on_the_slot_layout_compiles_for_hopper(tmp_path):
    """MegaDecoderLayer's 'slots' regime of a Qwen3-30B-A3B layer (one or two sequences): the
    sparse block on MegaMoE's 'slots' tiles, bf16, static, for sm_90a."""
    from cutemk.layers import MoeConfig
    from cutemk.nn import MOE_TILES

    moe = MoeConfig(2048, 768, 128, 8, router_dtype=None, **MOE_TILES[("cute", "slots")])
    g = decoder_layer_graph(mk.sym("B", max=2), _QWEN3_30B_DECODE, torch.bfloat16, moe=moe)
    assert "moe_route" not in {n.op.name for n in g.nodes}
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert "wgmma.mma_async" in ptx_file.read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_mega_moe_decoder_layer_on_the_gpu(scheduler):
    """A Qwen3-MoE decoder layer's decode steps on the GPU (bf16) against HF's layer: one and
    two sequences run the 'slots' regime (the sparse block without a routing step), three the
    'gemv' one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    from cutemk.nn import MegaDecoderLayer

    cfg = replace(_GPU_CFG, intermediate=256)
    layer, rotary = _hf_moe(cfg, 8, 2, 256)
    mega = MegaDecoderLayer.from_hf(
        layer.to(torch.bfloat16),
        page_size=16,
        max_pages=64,
        max_positions=2048,
        max_batch=8,
        scheduler=scheduler,
    ).cuda()
    assert mega.regimes() == ("slots", "gemv")
    layer.float()
    gen = torch.Generator().manual_seed(4)
    for lens in ([300], [1, 77], [5, 1024, 9]):
        inputs, want = _step_case(layer, rotary, cfg, lens, gen)
        err = _gpu_step_err(mega, inputs, want)
        assert err < 3e-2, (lens, err)


# -- a decode step's batch as device data (one capture for every batch) --------------------
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

    layer, rotary = _hf(CFG)
    kw = dict(page_size=CFG.page_size, max_pages=CFG.max_pages, max_positions=256)
    mega = MegaDecoderLayer.from_hf(layer, **kw, max_batch=5, backend="interpret")
    gen = torch.Generator().manual_seed(8)
    inputs, want = _step_case(layer, rotary, CFG, [3, 40, 17], gen)
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
    from cutemk.nn import MegaDecoderLayer

    mega = MegaDecoderLayer.__new__(MegaDecoderLayer)  # its graphs need no weights
    torch.nn.Module.__init__(mega)
    mega.cfg, mega.moe, mega.max_batch, mega.max_prefill_tokens = _QWEN3_8B_DECODE, None, 64, 0
    mega.prefill_tiles = None
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
        mk.sym("B", max=16), replace(_QWEN3_8B_DECODE, fused_qkv_tail=fused_tail), torch.bfloat16
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
    g = decoder_layer_graph(mk.sym("B", max=64), _QWEN3_30B_DECODE, torch.bfloat16, moe=moe)
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
        cfg = _GPU_CFG
        layer, rotary = _hf(cfg)
    else:  # the sparse block's top-k is bound to the live count too: absent rows route nowhere
        cfg = replace(_GPU_CFG, intermediate=256)
        layer, rotary = _hf_moe(cfg, 8, 2, 256)
    gen = torch.Generator().manual_seed(9)
    lens = [int(v) for v in torch.randint(1, 300, (rows,), generator=gen)]
    inputs, want = _step_case(layer, rotary, cfg, lens, gen)
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
