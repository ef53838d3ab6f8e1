"""``ops.qk_norm_rope`` against Hugging Face's Qwen3 pieces (``Qwen3RMSNorm`` on each head,
``Qwen3RotaryEmbedding`` + ``apply_rotary_pos_emb``) on random positions: interpreter on the
CPU in fp32, a compile of the kernel for sm_90a, and (``gpu``) the megakernel in bf16. A
position outside the rotary table makes that token's q and k NaN."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.runtime import compile_offline

HQ, HKV, D, MAXPOS = 8, 2, 64, 512


def _graph(dtype, hq=HQ, hkv=HKV, d=D, maxpos=MAXPOS, head_block=4):
    g = mk.Graph("qk_norm_rope")
    T = mk.sym("T", min=1, max=256)
    qkv = g.input("qkv", (T, (hq + 2 * hkv) * d), dtype)
    qw = g.weight("q_weight", (d,), dtype)
    kw = g.weight("k_weight", (d,), dtype)
    cs = g.weight("cos_sin", (maxpos, d), torch.float32)
    pos = g.input("positions", (T,), torch.int32)
    q, k, v = g.call(
        ops.qk_norm_rope, qkv, qw, kw, cs, pos, heads=hq, kv_heads=hkv, head_block=head_block
    )
    for name, val in (("q", q), ("k", k), ("v", v)):
        g.output(val, name)
    return g


def _hf(qkv, qw, kw, positions, hq=HQ, hkv=HKV, d=D, eps=1e-6, theta=1_000_000.0):
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = Qwen3Config(
        hidden_size=hq * d,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=d,
        rope_theta=theta,
        max_position_embeddings=MAXPOS,
    )
    t = qkv.shape[0]
    x = qkv.float().view(t, hq + 2 * hkv, d)
    qn, kn = Qwen3RMSNorm(d, eps), Qwen3RMSNorm(d, eps)
    with torch.no_grad():
        qn.weight.copy_(qw.float())
        kn.weight.copy_(kw.float())
        q = qn(x[:, :hq]).transpose(0, 1)[None]  # (1, Hq, T, D)
        k = kn(x[:, hq : hq + hkv]).transpose(0, 1)[None]
        cos, sin = Qwen3RotaryEmbedding(cfg)(x, positions.long()[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1), x[:, hq + hkv :]


def _inputs(t, gen, dtype=torch.float32, device="cpu"):
    return {
        "qkv": torch.randn(t, (HQ + 2 * HKV) * D, generator=gen).to(dtype).to(device),
        "q_weight": (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).to(device),
        "k_weight": (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).to(device),
        "cos_sin": ops.rope_table(MAXPOS, D).to(device),
        "positions": torch.randint(0, MAXPOS, (t,), generator=gen, dtype=torch.int32).to(device),
    }


# head blocks of 5 of the 12 heads: tiles across the q/k and k/v boundaries, a short last one
@pytest.mark.parametrize("head_block", [4, 5])
def test_matches_hf_interpreted(head_block):
    pytest.importorskip("transformers")
    c = _graph(torch.float32, head_block=head_block).compile("interpret", num_sms=4)
    gen = torch.Generator().manual_seed(0)
    for t in (1, 5, 37):
        a = _inputs(t, gen)
        q, k, v = c(**a)
        hq, hk, hv = _hf(a["qkv"], a["q_weight"], a["k_weight"], a["positions"])
        torch.testing.assert_close(q, hq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, hk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, hv)


def test_position_outside_the_table_is_nan():
    c = _graph(torch.float32).compile("interpret", num_sms=2)
    a = _inputs(6, torch.Generator().manual_seed(1))
    a["positions"][2] = MAXPOS
    q, k, v = c(**a)
    assert torch.isnan(q[2]).all() and torch.isnan(k[2]).all()
    assert not torch.isnan(q[[0, 1, 3, 4, 5]]).any() and not torch.isnan(v).any()


def test_compiles_for_hopper(tmp_path):
    g = _graph(torch.bfloat16, hq=32, hkv=8, d=128, maxpos=40960)
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert "shfl.sync.bfly" in ptx_file.read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("head_block", [4, 5])
def test_matches_hf_on_the_gpu(head_block):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    c = _graph(torch.bfloat16, head_block=head_block).compile("cute", poison_outputs=True)
    gen = torch.Generator().manual_seed(2)
    for t in (1, 7, 200):
        a = _inputs(t, gen, torch.bfloat16, "cuda")
        q, k, v = c(**a)
        hq, hk, hv = _hf(
            a["qkv"].cpu(), a["q_weight"].cpu(), a["k_weight"].cpu(), a["positions"].cpu()
        )
        torch.testing.assert_close(q.float().cpu(), hq, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(k.float().cpu(), hk, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v.float().cpu(), hv.float(), rtol=1e-2, atol=1e-2)


# -- the fused decode tail: a split projection's partials in, k and v appended to the cache --
SPLITS, K_IN, PAGE, MAX_PAGES, PAGES = 3, 48, 8, 6, 128


def _fused_graph(dtype, norm=True, head_block=4, k_in=K_IN):
    g = mk.Graph("qk_norm_rope_fused")
    T = mk.sym("T", min=1, max=64)
    part = g.input("part", (SPLITS, T, (HQ + 2 * HKV) * D), torch.float32)
    qw = g.weight("q_weight", (D,), dtype)
    kw = g.weight("k_weight", (D,), dtype)
    cs = g.weight("cos_sin", (MAXPOS, D), torch.float32)
    pos = g.input("positions", (T,), torch.int32)
    x = [g.input("x", (T, k_in), dtype)] if norm else []
    kc = g.input("k_cache", (PAGES, PAGE, HKV, D), dtype)
    vc = g.input("v_cache", (PAGES, PAGE, HKV, D), dtype)
    pt = g.input("page_table", (T, MAX_PAGES), torch.int32)
    lens = g.input("seq_lens", (T,), torch.int32)
    q, k2, v2 = g.call(
        ops.qk_norm_rope,
        part,
        qw,
        kw,
        cs,
        pos,
        *x,
        kc,
        vc,
        pt,
        lens,
        heads=HQ,
        kv_heads=HKV,
        head_block=head_block,
        norm_eps=1e-6 if norm else None,
        out_dtype=dtype,
    )
    for name, val in (("q", q), ("k_cache_out", k2), ("v_cache_out", v2)):
        g.output(val, name)
    return g


def _fused_inputs(t, gen, dtype=torch.float32, device="cpu", norm=True, k_in=K_IN):
    """Every token its own pages (disjoint, shuffled), the table's unused columns valid pages
    no token owns. Where t > 4, bad data: token 1 has no new row (length 0), token 2 a page id
    outside the cache at its position, token 3 a length past the table's capacity, token 4 page
    -1 at its position (none of these writes), and token 0 a position outside the rotary table
    (its q and k are NaN, and that k goes into the cache)."""
    a = _inputs(t, gen)
    del a["qkv"]
    a["part"] = torch.randn(SPLITS, t, (HQ + 2 * HKV) * D, generator=gen)
    if norm:
        a["x"] = 1 + torch.randn(t, k_in, generator=gen)
    a["k_cache"] = torch.randn(PAGES, PAGE, HKV, D, generator=gen)
    a["v_cache"] = torch.randn(PAGES, PAGE, HKV, D, generator=gen)
    used = MAX_PAGES // 2
    perm = torch.randperm(PAGES, generator=gen).int()
    spare = perm[t * used :]  # pages no token owns
    a["page_table"] = spare[torch.arange(t * MAX_PAGES) % len(spare)].view(t, MAX_PAGES).clone()
    a["page_table"][:, :used] = perm[: t * used].view(t, used)
    a["seq_lens"] = torch.randint(1, PAGE * used + 1, (t,), generator=gen).int()
    if t > 4:
        a["seq_lens"][1] = 0
        a["page_table"][2, (a["seq_lens"][2] - 1) // PAGE] = PAGES
        a["seq_lens"][3] = PAGE * MAX_PAGES + 1
        a["page_table"][4, (a["seq_lens"][4] - 1) // PAGE] = -1
        a["positions"][0] = MAXPOS
    for k in ("part", "x", "k_cache", "v_cache", "q_weight", "k_weight"):
        if k in a:
            a[k] = a[k].to(torch.float32 if k == "part" else dtype)
    return {k: v.to(device) for k, v in a.items()}


def _fused_expected(a, norm=True):
    """q and the caches after the step, from Hugging Face's pieces on the summed (and
    row-normalised) partials."""
    y = a["part"].float().sum(0)
    if norm:
        x = a["x"].float()
        y = y * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    pos = a["positions"]
    bad = (pos < 0) | (pos >= MAXPOS)
    q, k, v = _hf(y, a["q_weight"], a["k_weight"], pos.clamp(0, MAXPOS - 1))
    q[bad], k[bad] = float("nan"), float("nan")  # a position outside the table: NaN
    kc, vc = a["k_cache"].float().clone(), a["v_cache"].float().clone()
    for tok in range(y.shape[0]):
        p = int(a["seq_lens"][tok]) - 1
        if not 0 <= p < MAX_PAGES * PAGE:
            continue
        pg = int(a["page_table"][tok, p // PAGE])
        if 0 <= pg < PAGES:
            kc[pg, p % PAGE] = k[tok]
            vc[pg, p % PAGE] = v[tok]
    return q, kc, vc


@pytest.mark.parametrize("norm,head_block", [(True, 4), (True, 5), (False, 4)])
def test_fused_tail_matches_hf_interpreted(norm, head_block):
    """The partials summed (and scaled by x's folded norm) in the tile, k and v into the
    pages; a length-0 row and a page outside the cache write nothing (the rest of the caches
    keeps its values: compared whole)."""
    pytest.importorskip("transformers")
    g = _fused_graph(torch.float32, norm=norm, head_block=head_block)
    assert not any(n.op.name in ("gemm_split_reduce", "kv_append") for n in g.nodes)
    c = g.compile("interpret", num_sms=4)
    gen = torch.Generator().manual_seed(4)
    for t in (1, 5):
        a = _fused_inputs(t, gen, norm=norm)
        want_q, want_k, want_v = _fused_expected({k: v.clone() for k, v in a.items()}, norm)
        q, kc, vc = c(**a)
        if t > 4:  # the bad position's q and k are NaN, the rest is not
            assert torch.isnan(q[0]).all() and not torch.isnan(q[1:]).any()
        for got, want in ((q, want_q), (kc, want_k), (vc, want_v)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_fused_tail_checks_its_arguments():
    spec = mk.TensorSpec
    part = spec((2, 4, (HQ + 2 * HKV) * D), torch.float32)
    w, cs = spec((D,), torch.float32), spec((MAXPOS, D), torch.float32)
    pos = spec((4,), torch.int32)
    with pytest.raises(ValueError, match="out_dtype"):
        ops.qk_norm_rope(part, w, w, cs, pos, heads=HQ, kv_heads=HKV)
    with pytest.raises(ValueError, match="k_cache, v_cache"):
        ops.qk_norm_rope(part, w, w, cs, pos, pos, heads=HQ, kv_heads=HKV, out_dtype=torch.float32)
    cache = spec((PAGES, PAGE, HKV + 1, D), torch.float32)
    table, lens = spec((4, MAX_PAGES), torch.int32), spec((4,), torch.int32)
    with pytest.raises(mk.ShapeError, match="cache heads"):
        ops.qk_norm_rope(
            part,
            w,
            w,
            cs,
            pos,
            cache,
            cache,
            table,
            lens,
            heads=HQ,
            kv_heads=HKV,
            out_dtype=torch.float32,
        )


def test_fused_tail_checks_the_folded_norm():
    """x must be static-width, its eps positive, and the width of the partial GEMM's K."""
    spec = mk.TensorSpec
    T = mk.sym("T", min=1, max=8)
    part = spec((2, T, (HQ + 2 * HKV) * D), torch.float32)
    w, cs, pos = (
        spec((D,), torch.float32),
        spec((MAXPOS, D), torch.float32),
        spec((T,), torch.int32),
    )
    kw = {"heads": HQ, "kv_heads": HKV, "out_dtype": torch.float32}
    with pytest.raises(mk.ShapeError, match="static"):
        ops.qk_norm_rope(
            part, w, w, cs, pos, spec((T, mk.sym("K", max=64)), torch.float32), norm_eps=1e-6, **kw
        )
    with pytest.raises(ValueError, match="positive"):
        ops.qk_norm_rope(part, w, w, cs, pos, spec((T, K_IN), torch.float32), norm_eps=0.0, **kw)
    g = mk.Graph("wrong_x")
    a = g.input("a", (T, 128), torch.float32)
    x = g.input("x", (T, 136), torch.float32)
    wq = g.weight("w", ((HQ + 2 * HKV) * D, 128), torch.float32)
    p = g.call(ops.gemm_partial, a, wq, split_k=2, block_m=16, block_n=32)
    leaves = [g.weight(n, (D,), torch.float32) for n in ("qw", "kw")]
    q, _, _ = g.call(
        ops.qk_norm_rope,
        p,
        *leaves,
        g.weight("cs", (MAXPOS, D), torch.float32),
        g.input("pos", (T,), torch.int32),
        x,
        norm_eps=1e-6,
        **kw,
    )
    g.output(q, "q")
    with pytest.raises(mk.GraphError, match="K is"):
        g.validate()


def test_fused_tail_compiles_for_hopper(tmp_path, spill_stores):
    g = _fused_graph(torch.bfloat16)
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert "shfl.sync.bfly" in ptx_file.read_text()
    assert spill_stores(ptx_file) == 0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "norm,head_block,k_in", [(True, 4, K_IN), (True, 5, K_IN), (False, 4, K_IN), (True, 4, 4096)]
)
def test_fused_tail_on_the_gpu(norm, head_block, k_in):
    """k_in 4096 (Qwen3-8B's hidden size): x's row in whole rounds of 16-byte vectors."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    bf = torch.bfloat16
    g = _fused_graph(bf, norm=norm, head_block=head_block, k_in=k_in)
    c = g.compile("cute", poison_outputs=True)
    gen = torch.Generator().manual_seed(5)
    for t in (1, 7, 40):
        a = _fused_inputs(t, gen, bf, norm=norm, k_in=k_in)
        want_q, want_k, want_v = _fused_expected({k: v.clone() for k, v in a.items()}, norm)
        q, kc, vc = c(**{k: v.cuda() for k, v in a.items()})
        for got, want in ((q, want_q), (kc, want_k), (vc, want_v)):
            got = got.float().cpu()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, equal_nan=True)


def test_heads_and_eps_are_checked():
    """``eps`` <= 0 gave NaN q and k with no error, ``heads=0`` an empty q, ``kv_heads=-1`` a
    ZeroDivisionError."""
    import cutemk as mk
    from cutemk import ops

    T = mk.sym("T", max=16)
    for kwargs, err, match in [
        (dict(heads=4, kv_heads=2, eps=-1.0), ValueError, "eps must be positive"),
        (dict(heads=4, kv_heads=2, eps=0.0), ValueError, "eps must be positive"),
        (dict(heads=4, kv_heads=2, eps=float("nan")), ValueError, "eps must be"),
        (dict(heads=4, kv_heads=2, eps="1e-6"), TypeError, "eps must be a number"),
        (dict(heads=0, kv_heads=2), ValueError, "heads must be a positive int"),
        (dict(heads=2, kv_heads=-1), ValueError, "kv_heads must be a positive int"),
    ]:
        g = mk.Graph("qk")
        qkv = g.input("qkv", (T, 8 * 32))
        qw, kw = g.weight("qw", (32,)), g.weight("kw", (32,))
        cs = g.input("cos_sin", (64, 32))
        pos = g.input("positions", (T,), torch.int32)
        with pytest.raises(err, match=match):
            g.call(ops.qk_norm_rope, qkv, qw, kw, cs, pos, **kwargs)
