"""Fuzz: random MoE layers, routings and token counts against torch.

Each case draws a layer (experts, top-k, tiles, one-task or chunked routing), a token count
(odd ones included) and a routing: random logits, exact ties (identical router rows), or bad
rows (tokens whose activations are NaN or inf, so their router logits are). A token with a bad
row must come out all NaN (as the Hugging Face block gives it) and every other token must match
the fp32 torch reference. CPU: the interpreter (race checker on). GPU (``gpu``): the bf16
megakernel with both schedulers, outputs NaN-poisoned before each launch, bit-identical on a
second launch.
"""

import random

import pytest
import torch

import cutemk as mk
from cutemk.layers import MoeConfig, moe_graph, moe_reference

ROUTINGS = ("random", "ties", "bad_rows")


def _case(rng: random.Random, gpu: bool):
    """(cfg, T values, routing) of one fuzz case."""
    e = rng.choice([4, 8, 16] if not gpu else [8, 16, 64])
    k = rng.randint(1, min(4, e))
    if gpu:  # the Hopper tiles: 64-row grouped tiles, TMA-aligned widths
        h, i = rng.choice([(256, 128), (512, 256)])
        tiles = dict(block_m=64, block_n=64, down_block_n=128)
        max_t = 4096
    else:
        h, i = rng.choice([(32, 16), (64, 32)])
        tiles = dict(block_m=16, block_n=32)
        max_t = 96
    chunk = rng.choice([None, 3, 16] if not gpu else [None, 32, 64])
    cfg = MoeConfig(h, i, e, k, norm_topk_prob=rng.random() < 0.7, route_chunk=chunk, **tiles)
    ts = sorted({1, rng.randint(2, 17), rng.randint(18, max_t), max_t - rng.randint(0, 3)})
    return cfg, ts, rng.choice(ROUTINGS), max_t


def _inputs(cfg: MoeConfig, t: int, routing: str, gen: torch.Generator, device, dtype):
    e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate
    w = {
        "w_router": torch.randn(e, h, generator=gen),
        "w_gate_up": torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
        "w_down": torch.randn(e, h, i, generator=gen) / i**0.5,
    }
    if routing == "ties":  # experts 1 and 2 (and 0 and 3) share router rows: exact ties
        w["w_router"][2] = w["w_router"][1]
        w["w_router"][3] = w["w_router"][0]
    x = torch.randn(t, h, generator=gen)
    bad = torch.zeros(t, dtype=torch.bool)
    if routing == "bad_rows":
        bad = torch.rand(t, generator=gen) < 0.2
        x[bad] = float("nan")
        if t > 1:  # one row of infinities (its logits are inf or NaN)
            x[t // 2] = float("inf")
            bad[t // 2] = True
    cast = {k: v.to(device, dtype) for k, v in w.items()}
    return x.to(device, dtype), cast, bad.to(device)


def _check(y: torch.Tensor, x, w, cfg: MoeConfig, bad: torch.Tensor, tol: float, what: str):
    ref = moe_reference(x, **w, top_k=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob)
    assert torch.isnan(y[bad]).all(), f"{what}: a token with a bad row is not all NaN"
    good = ~bad
    if good.any():
        yg, rg = y[good].float(), ref[good]
        assert torch.isfinite(yg).all(), f"{what}: a good token came out non-finite"
        err = ((yg - rg).norm() / rg.norm().clamp_min(1e-6)).item()
        assert err < tol, f"{what}: rel err {err:.3g}"


@pytest.mark.parametrize("seed", range(30))
def test_fuzz_moe_interpreted(seed):
    rng = random.Random(seed)
    cfg, ts, routing, max_t = _case(rng, gpu=False)
    gen = torch.Generator().manual_seed(seed)
    scheduler = rng.choice(["static", "dynamic"])
    c = moe_graph(mk.sym("T", max=max_t), cfg).compile("interpret", scheduler=scheduler, seed=seed)
    for t in ts:
        x, w, bad = _inputs(cfg, t, routing, gen, "cpu", torch.float32)
        _check(c(x, **w), x, w, cfg, bad, 1e-4, f"seed {seed} {cfg} {routing} T={t}")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_fuzz_moe_on_the_gpu(seed):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rng = random.Random(1000 + seed)
    cfg, ts, routing, max_t = _case(rng, gpu=True)
    gen = torch.Generator().manual_seed(seed)
    g = moe_graph(mk.sym("T", max=max_t), cfg, torch.bfloat16)
    for scheduler in ("static", "dynamic"):
        c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
        for t in ts:
            x, w, bad = _inputs(cfg, t, routing, gen, "cuda", torch.bfloat16)
            y = c(x, **w)
            _check(y, x, w, cfg, bad, 2e-2, f"seed {seed} {cfg} {routing} {scheduler} T={t}")
            yy = c(x, **w)
            same = (yy == y) | (torch.isnan(yy) & torch.isnan(y))
            assert same.all(), f"seed {seed} T={t}: a second launch differs"


@pytest.mark.parametrize("seed", range(10))
def test_fuzz_decode_attention_interpreted(seed):
    """Random GQA shapes, page sizes, splits, batch sizes and lengths (with scattered pages)
    against fp32 SDPA; a sequence given a bad page or length comes out NaN, the others exact."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_attention_decode import _graph as attention_graph
    from test_attention_decode import _inputs as attention_inputs

    from cutemk.ops.attention_decode import decode_attention_reference

    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 2, 4, 8])
    d = rng.choice([32, 64])
    page = rng.choice([1, 4, 16])
    max_pages = rng.choice([8, 40])
    split = rng.choice([4, 16, 64])
    cap = page * max_pages
    c = attention_graph(hq, hkv, d, page, max_pages, split, torch.float32).compile(
        "interpret", num_sms=rng.choice([1, 3, 8]), scheduler=rng.choice(["static", "dynamic"])
    )
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, cap) for _ in range(rng.randint(1, 5))]
    a = attention_inputs(lens, hq, hkv, d, page, max_pages, torch.float32, gen)
    bad = set()
    if len(lens) > 1 and rng.random() < 0.5:  # one sequence gets bad data
        b = rng.randrange(len(lens))
        bad.add(b)
        if rng.random() < 0.5:
            a["page_table"][b, rng.randrange(-(-lens[b] // page))] = -3
        else:
            a["seq_lens"][b] = rng.choice([0, -1, cap + 1])
    out = c(**a)
    good = [b for b in range(len(lens)) if b not in bad]
    ref = decode_attention_reference(**{k: (v if "cache" in k else v[good]) for k, v in a.items()})
    torch.testing.assert_close(out[good], ref, rtol=1e-4, atol=1e-4)
    for b in bad:
        assert torch.isnan(out[b]).all()


def _mlp_case(rng: random.Random, gpu: bool):
    """(hidden, intermediate, tiles, split_k, max T, T values) of one MLP fuzz case: tile shapes,
    K splits (given, chosen from the sizes, none) and token counts past a tile's edge."""
    from cutemk.layers import mlp_graph

    if gpu:
        h, i = rng.choice([(256, 384), (512, 512), (1024, 768)])
        tiles = rng.choice([((64, 64), None), ((64, 128), (64, 64)), ((128, 96), (128, 256))])
        max_t = rng.choice([16, 128, 1024])
    else:
        h, i = rng.choice([(128, 128), (256, 128), (128, 384)])  # K splits in whole slices
        tiles = rng.choice([((16, 32), None), ((8, 16), (16, 64)), ((32, 32), (8, 32))])
        max_t = rng.choice([16, 40])
    split = rng.choice([1, 2, None, (1, None), (None, 2)])
    (bm, bn), down = tiles
    dtype = torch.bfloat16 if gpu else torch.float32
    g = mlp_graph(mk.sym("T", max=max_t), h, i, dtype, bm, bn, True, down, split)
    ts = sorted({1, rng.randint(2, max_t), max_t})
    return g, h, i, ts, f"h={h} i={i} tiles={tiles} split={split} max={max_t}"


@pytest.mark.parametrize("seed", range(20))
def test_fuzz_mlp_interpreted(seed):
    """Random MLP graphs (tiles, split-K choices, token counts) against fp32 torch."""
    from cutemk.layers import mlp_reference

    rng = random.Random(500 + seed)
    g, h, i, ts, what = _mlp_case(rng, gpu=False)
    c = g.compile(
        "interpret", num_sms=rng.choice([1, 4, 9]), scheduler=rng.choice(["static", "dynamic"])
    )
    gen = torch.Generator().manual_seed(seed)
    w_gu = torch.randn(2 * i, h, generator=gen) / h**0.5
    w_d = torch.randn(h, i, generator=gen) / i**0.5
    for t in ts:
        x = torch.randn(t, h, generator=gen)
        ref = mlp_reference(x, w_gu, w_d)
        err = ((c(x, w_gu, w_d) - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"seed {seed} {what} T={t}: rel err {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_fuzz_mlp_on_the_gpu(seed):
    """Random bf16 MLP graphs on the Hopper tiles, both schedulers, outputs NaN-poisoned,
    bit-identical on a second launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from cutemk.layers import mlp_reference

    rng = random.Random(1500 + seed)
    g, h, i, ts, what = _mlp_case(rng, gpu=True)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w_gu = (torch.randn(2 * i, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    w_d = (torch.randn(h, i, device="cuda", generator=gen) / i**0.5).bfloat16()
    for scheduler in ("static", "dynamic"):
        c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
        for t in ts:
            x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
            y = c(x, w_gu, w_d)
            ref = mlp_reference(x, w_gu, w_d)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"seed {seed} {what} {scheduler} T={t}: rel err {err:.3g}"
            assert torch.equal(c(x, w_gu, w_d), y), f"seed {seed} T={t}: a second launch differs"
