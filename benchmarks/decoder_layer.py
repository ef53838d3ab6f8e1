"""One decode step of a Qwen3-8B decoder layer (H=4096, I=12288, 32 query / 8 KV heads, head
dim 128, bf16) with every sequence at KV length 4096: ``cutemk.nn.MegaDecoderLayer`` (one
megakernel, paged KV cache) vs the same layer in plain torch (cuBLAS GEMMs, SDPA, a static
contiguous KV cache, in-place cache writes), eager and under a CUDA graph, in one process.

``--moe``: a Qwen3-30B-A3B layer instead (H=2048, 32 query / 4 KV heads, head dim 128, a sparse
block of 128 experts, top-8, I=768); its torch step runs the block as ``benchmarks/moe.py``'s
torch pipeline (``torch._grouped_mm``), its fp32 reference as ``cutemk.layers.moe_reference``
(both routing on bf16-rounded logits, as HF and the megakernel do).

Columns: median_us, floor_us = (layer weights + the KV cache read) / 4.3 TB/s (a sparse
block: the router and the experts the step's routing touches), of_floor, rel_err against an
fp32 torch step, ``speedup_vs_torch_graph``.

The megakernel gets the layer's weights with the RMSNorm weights folded into the projections
after them (``cutemk.layers.fold_decoder_norms``, as ``MegaDecoderLayer.from_hf`` does; the norms then
run inside the split projections' reduce tiles); ``--unfolded-norms`` keeps them as phases.

``--trace``: a profiled static module's per-node spans (tasks, SMs, first start, last end,
median task time; microseconds since the launch's first task) go to the JSON's ``trace`` and
are printed; ``--records DIR`` also writes each case's raw per-task records (SM, start, end,
node) to ``DIR/decoder_layer_records_B<b>.json`` for a per-SM look.

``--ab FIELD[=INT] ...``: one more column each, a static module with that ``DecoderConfig``
field set (a switch alone: on; e.g. ``fused_qkv_tail=0``: the q/k/v tail in three phases in
every regime, where ``MegaDecoderLayer`` fuses it up to 8 sequences; ``fused_append``:
``qk_norm_rope`` appends, no ``kv_append``; ``A+B``: both fields in one module), timed in the
same process. ``--set
FIELD=VALUE``: change the layer's config for every module (the traced one too), for a
separate-process A/B with a trace.

``--prefill 2048``: also prefill steps (one sequence of that many new tokens, no cached prefix)
as one megakernel (``MegaDecoderLayer.prefill``, 128 x 128 GEMM tiles) vs the same layer in torch
(cuBLAS, causal SDPA), eager and under a CUDA graph; ``--batch`` with no count runs only those.
With ``--trace`` the prefill steps are traced too.

Run: python benchmarks/decoder_layer.py [--moe] [--batch 1 16 64] [--quick] [--trace [slices]
[--records DIR]] [--idle-ties]
[--unfolded-norms] [--attention-align 64|128] [--ab FIELD ...] [--set FIELD=VALUE ...]
[--rounds N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from cutemk.bench import (
    Results,
    add_trace_argument,
    floor_us,
    profile_launch,
    time_impl,
    time_rounds,
)

KV, PAGE, EPS = 4096, 16, 1e-6


@dataclasses.dataclass(frozen=True)
class Layer:
    """The layer's dims: a dense MLP of ``intermediate``, or (``experts``) a sparse block of
    that many experts of ``intermediate`` each, ``top_k`` a token."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    top_k: int = 0


QWEN3_8B = Layer("Qwen3-8B", 4096, 12288, 32, 8, 128)
QWEN3_30B_A3B = Layer("Qwen3-30B-A3B", 2048, 768, 32, 4, 128, experts=128, top_k=8)


def _weights(gen, dims: Layer):
    dt = torch.bfloat16
    h, i, hq, hkv, d = dims.hidden, dims.intermediate, dims.heads, dims.kv_heads, dims.head_dim

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    from cutemk.ops import rope_table

    w = {
        "input_norm": 1 + rnd(h, scale=0.1),
        "w_qkv": rnd((hq + 2 * hkv) * d, h, scale=h**-0.5),
        "q_norm": 1 + rnd(d, scale=0.1),
        "k_norm": 1 + rnd(d, scale=0.1),
        "cos_sin": rope_table(KV + 1, d).cuda(),
        "w_o": rnd(h, hq * d, scale=(hq * d) ** -0.5),
        "post_norm": 1 + rnd(h, scale=0.1),
    }
    if dims.experts:
        e = dims.experts
        w["w_router"] = rnd(e, h, scale=h**-0.5)
        w["w_gate_up"] = rnd(e, 2 * i, h, scale=h**-0.5)
        w["w_down"] = rnd(e, h, i, scale=i**-0.5)
    else:
        w["w_gate_up"] = rnd(2 * i, h, scale=h**-0.5)
        w["w_down"] = rnd(h, i, scale=i**-0.5)
    return w


def _mlp(h1, h2, w, dims: Layer, fp32: bool):
    """The layer's second half after its norm: ``h1 + mlp(h2)``; a sparse block through torch's
    grouped GEMM pipeline, or (``fp32``) the fp32 reference, both routing on bf16-rounded
    logits as HF does."""
    if dims.experts:
        ws = (w["w_router"], w["w_gate_up"], w["w_down"])
        if fp32:
            from cutemk.layers import moe_reference

            y = moe_reference(h2, *ws, top_k=dims.top_k, router_dtype=torch.bfloat16)
        else:
            from moe import torch_moe  # benchmarks/moe.py, beside this script

            y = torch_moe(h2, *ws, top_k=dims.top_k)
        return h1 + y.to(h1.dtype)
    i = dims.intermediate
    gu = h2 @ w["w_gate_up"].T
    return h1 + (F.silu(gu[:, :i]) * gu[:, i:]) @ w["w_down"].T


def _weight_bytes(w, dims: Layer, touched: int | None = None) -> float:
    """Bytes of the weights a step reads: every one but the rotary table; of a sparse block's
    experts only the ``touched`` ones."""
    total = 2.0 * sum(t.numel() for k, t in w.items() if k not in ("cos_sin",))
    if dims.experts:
        per_expert = 2.0 * 3 * dims.hidden * dims.intermediate
        total -= per_expert * (dims.experts - (dims.experts if touched is None else touched))
    return total


def _touched_experts(x, pos, kc, vc, w, n, dims: Layer) -> int | None:
    """How many experts the fp32 step's routing picks (None for a dense layer)."""
    if not dims.experts:
        return None
    h2 = torch_step(x, pos, kc, vc, w, n, dims, fp32=True, until_norm=True)
    logits = (h2 @ w["w_router"].float().T).to(torch.bfloat16).float()
    return int(torch.unique(torch.topk(logits, dims.top_k, dim=-1).indices).numel())


def torch_step(x, pos, kc, vc, w, n, dims: Layer, fp32=False, until_norm=False):
    """The decode step in torch on a static cache kc / vc (B, Hkv, L, D), written in place at
    ``pos``; attention over the first ``n`` positions (every sequence at length n, a Python int:
    no device sync, so the step captures in a CUDA graph). ``fp32``: every operand in fp32.
    ``until_norm``: the post-attention norm's output (what the MLP or the router reads)."""
    H, HQ, HKV, D = dims.hidden, dims.heads, dims.kv_heads, dims.head_dim  # noqa: N806
    cast = (lambda t: t.float()) if fp32 else (lambda t: t)
    w = {k: cast(v) for k, v in w.items()}
    x = cast(x)
    b = x.shape[0]
    h = F.rms_norm(x, (H,), w["input_norm"], EPS)
    qkv = h @ w["w_qkv"].T
    q = qkv[:, : HQ * D].view(b, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(b, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(b, HKV, D)
    q = F.rms_norm(q, (D,), w["q_norm"], EPS)
    k = F.rms_norm(k, (D,), w["k_norm"], EPS)
    cs = w["cos_sin"][pos.long()].to(q.dtype)
    cos, sin = cs[:, None, : D // 2], cs[:, None, D // 2 :]

    def rope(t):
        t1, t2 = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)

    q, k = rope(q), rope(k)
    idx = torch.arange(b, device=x.device)
    kc[idx, :, pos.long()] = k.to(kc.dtype)
    vc[idx, :, pos.long()] = v.to(vc.dtype)
    att = F.scaled_dot_product_attention(
        q[:, :, None], cast(kc[:, :, :n]), cast(vc[:, :, :n]), enable_gqa=True
    )
    h1 = x + att.reshape(b, HQ * D) @ w["w_o"].T
    h2 = F.rms_norm(h1, (H,), w["post_norm"], EPS)
    if until_norm:
        return h2
    return _mlp(h1, h2, w, dims, fp32)


def torch_prefill(x, kc, vc, w, dims: Layer, fp32=False):
    """A prefill step of one sequence of T new tokens (no cached prefix) in torch on a static
    cache kc / vc (1, Hkv, L, D), written in place at positions 0..T-1; causal SDPA."""
    H, HQ, HKV, D = dims.hidden, dims.heads, dims.kv_heads, dims.head_dim  # noqa: N806
    cast = (lambda t: t.float()) if fp32 else (lambda t: t)
    w = {k: cast(v) for k, v in w.items()}
    x = cast(x)
    t = x.shape[0]
    h = F.rms_norm(x, (H,), w["input_norm"], EPS)
    qkv = h @ w["w_qkv"].T
    q = F.rms_norm(qkv[:, : HQ * D].view(t, HQ, D), (D,), w["q_norm"], EPS)
    k = F.rms_norm(qkv[:, HQ * D : (HQ + HKV) * D].view(t, HKV, D), (D,), w["k_norm"], EPS)
    v = qkv[:, (HQ + HKV) * D :].view(t, HKV, D)
    cs = w["cos_sin"][:t].to(q.dtype)
    cos, sin = cs[:, None, : D // 2], cs[:, None, D // 2 :]

    def rope(a):
        a1, a2 = a[..., : D // 2], a[..., D // 2 :]
        return torch.cat([a1 * cos - a2 * sin, a2 * cos + a1 * sin], dim=-1)

    q, k = rope(q), rope(k)
    kc[0, :, :t] = k.transpose(0, 1).to(kc.dtype)
    vc[0, :, :t] = v.transpose(0, 1).to(vc.dtype)
    att = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        cast(kc[:, :, :t]),
        cast(vc[:, :, :t]),
        is_causal=True,
        enable_gqa=True,
    )
    h1 = x + att[0].transpose(0, 1).reshape(t, HQ * D) @ w["w_o"].T
    h2 = F.rms_norm(h1, (H,), w["post_norm"], EPS)
    return _mlp(h1, h2, w, dims, fp32)


def _time_impls(res, case, impls, errs, fl, warmup, rep, flops=None, rounds=1) -> None:
    """Each of ``impls`` timed into a row of ``res`` (CUDA-graph replays from a cold L2, but
    'torch_eager', called as it is), with its error ``errs[name]``, its share of the floor
    ``fl`` and, given ``flops``, its TFLOP/s. ``rounds`` > 1: timed in that many rounds of
    rotated order (``cutemk.bench.time_rounds``), the row's median the median of the rounds'
    (each round's in ``rounds_us``)."""
    if rounds > 1:
        per = time_rounds(impls, {"torch_eager"}, warmup, rep, rounds)
        for name, us in per.items():
            res.add_timed(
                case,
                name,
                statistics.median(us),
                fl,
                flops,
                rel_err=round(errs[name], 5),
                rounds_us=[round(u, 2) for u in us],
            )
        return
    for name, fn in impls.items():
        us = time_impl(fn, name == "torch_eager", warmup, rep)
        res.add_timed(case, name, us, fl, flops, rel_err=round(errs[name], 5))


def run_prefill(res, megas, w, dims, tokens, warmup, rep, gen, profiled=None) -> None:
    """Prefill steps of one sequence of ``tokens`` new tokens: the layer as one megakernel
    (``MegaDecoderLayer.prefill``) vs the same layer in torch, eager and under a CUDA graph;
    with ``profiled`` (a module with ``profile`` set) the per-node trace of a step too. (The
    floor counts every expert of a sparse block: a prompt's tokens touch most of them.)"""
    H, HQ, HKV, D = dims.hidden, dims.heads, dims.kv_heads, dims.head_dim  # noqa: N806
    weight_bytes = _weight_bytes(w, dims)
    params = sum(w[k].numel() for k in ("w_qkv", "w_o"))
    mlp_params = w["w_gate_up"].numel() + w["w_down"].numel()
    if dims.experts:  # a token's FLOPs go through its top_k experts only
        mlp_params = mlp_params * dims.top_k // dims.experts
    params += mlp_params
    for t in tokens:
        case = f"prefill T={t}"
        x = torch.randn(t, H, device="cuda", generator=gen).bfloat16()
        pos = torch.arange(t, dtype=torch.int32, device="cuda")
        pages = -(-t // PAGE)
        kc = torch.zeros(1, HKV, pages * PAGE, D, device="cuda").bfloat16()
        vc = torch.zeros_like(kc)
        k_pages = torch.zeros(pages, PAGE, HKV, D, device="cuda").bfloat16()
        v_pages = torch.zeros_like(k_pages)
        table = torch.zeros(1, megas["mk_static"].cfg.max_pages, dtype=torch.int32, device="cuda")
        table[0, :pages] = torch.arange(pages, dtype=torch.int32, device="cuda")
        lens = torch.tensor([t], dtype=torch.int32, device="cuda")
        cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        ref = torch_prefill(x, kc.clone().float(), vc.clone().float(), w, dims, fp32=True)
        impls = {
            name: (lambda m=m: m(x, pos, k_pages, v_pages, table, lens, cu_seqlens=cu))
            for name, m in megas.items()
        }
        if profiled is not None:
            profile_launch(
                res,
                case,
                lambda: profiled(x, pos, k_pages, v_pages, table, lens, cu_seqlens=cu),
                profiled.compiled("prefill"),
                warmup,
                rep,
            )
        impls["torch_graph"] = lambda: torch_prefill(x, kc, vc, w, dims)
        errs = {n: ((f().float() - ref).norm() / ref.norm()).item() for n, f in impls.items()}
        impls["torch_eager"], errs["torch_eager"] = impls["torch_graph"], errs["torch_graph"]
        flops = 2.0 * t * params + 2.0 * t * t * D * HQ  # projections; causal attention
        fl = floor_us(flops, weight_bytes + 2.0 * 2 * t * HKV * D)
        _time_impls(res, case, impls, errs, fl, warmup, rep, flops=flops)


def _config_fields(p, cfg, items: list[str]) -> dict[str, int | bool]:
    """``FIELD=INT`` items (``FIELD`` alone: ``FIELD=1``) as DecoderConfig fields, checked: a
    known int or switch field (typed ``bool`` or ``bool | None``; its value as a bool), an int
    value."""
    types = {f.name: str(f.type).replace(" ", "") for f in dataclasses.fields(cfg)}
    out: dict[str, int | bool] = {}
    for item in items:
        name, _, value = item.partition("=")
        value = value or "1"
        if name not in types or not value.lstrip("-").isdigit():
            p.error(f"{item}: expected FIELD[=INT] with FIELD a DecoderConfig field")
        switch = types[name] in ("bool", "bool|None")
        if not switch and types[name] not in ("int", "int|None"):
            p.error(f"{item}: {name} is a {types[name]}, not an int or a switch")
        out[name] = bool(int(value)) if switch else int(value)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", nargs="*", type=int, default=[1, 16, 64])
    p.add_argument("--quick", action="store_true", help="3 warm-up, 10 timed runs")
    p.add_argument("--block-n", type=int, default=64, help="GEMM tile width (decode: 32 or 64)")
    add_trace_argument(p, "per-node spans")
    p.add_argument(
        "--prefill", nargs="*", type=int, default=[], help="prefill steps of these token counts"
    )
    p.add_argument(
        "--unfolded-norms", action="store_true", help="RMSNorm phases of their own (no folding)"
    )
    p.add_argument(
        "--ab",
        nargs="*",
        default=[],
        metavar="FIELD[=INT][+FIELD...]",
        help="also a static module with these DecoderConfig fields set (a switch: on, or =0)",
    )
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="DecoderConfig fields for every module (ints; booleans as 0 / 1)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the decode steps in this many rounds of rotated order (A/Bs)",
    )
    p.add_argument("--records", type=Path, help="with --trace: write raw task records here")
    p.add_argument(
        "--moe", action="store_true", help="a Qwen3-30B-A3B layer (sparse block) instead"
    )
    p.add_argument(
        "--idle-ties",
        action="store_true",
        help="also a static module whose scheduler breaks ties toward the SM free longest",
    )
    p.add_argument(
        "--attention-align", type=int, default=None, help="tokens per attention slice (64, 128)"
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="also time the static module with its batch as device data (forward_live: inputs "
        "at the largest --batch, the rows past the batch garbage aimed at sequence 0's pages)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from cutemk.layers import DecoderConfig, MoeConfig, fold_decoder_norms
    from cutemk.nn import MegaDecoderLayer

    warmup, rep = (3, 10) if args.quick else (10, 50)
    gen = torch.Generator(device="cuda").manual_seed(0)
    dims = QWEN3_30B_A3B if args.moe else QWEN3_8B
    H, HKV, D = dims.hidden, dims.kv_heads, dims.head_dim  # noqa: N806
    w = _weights(gen, dims)
    moe = None
    if dims.experts:  # the sparse block as MegaDecoderLayer.from_hf configures it
        moe = MoeConfig(
            H,
            dims.intermediate,
            dims.experts,
            dims.top_k,
            True,
            block_m=64,
            block_n=64,
            router_dtype=None,
        )
    cfg = DecoderConfig(
        hidden=H,
        intermediate=dims.intermediate,
        heads=dims.heads,
        kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        max_pages=(KV + PAGE) // PAGE + 1,
        max_positions=KV + 1,
        block_m=64,
        block_n=args.block_n,
        fold_norms=not args.unfolded_norms,
    )
    if args.attention_align is not None:
        cfg = dataclasses.replace(cfg, attention_align=args.attention_align)
    cfg = dataclasses.replace(cfg, **_config_fields(p, cfg, args.set))
    variants = {item: _config_fields(p, cfg, item.split("+")) for item in args.ab}
    wm = dict(w)  # the megakernel's weights: the norms folded in, as MegaDecoderLayer.from_hf
    if cfg.fold_norms:
        wm = fold_decoder_norms(wm, moe=moe is not None)
    prefill_kw = {}
    if args.prefill:  # the prefill graph: the new tokens at their maximum, 128 x 128 tiles
        prefill_kw = {"max_prefill_tokens": max(args.prefill), "prefill_tiles": (128, 128)}
        cfg = dataclasses.replace(
            cfg,
            max_pages=max(cfg.max_pages, -(-max(args.prefill) // PAGE)),
            max_positions=max(cfg.max_positions, max(args.prefill)),
        )
        from cutemk.ops import rope_table

        w["cos_sin"] = wm["cos_sin"] = rope_table(cfg.max_positions, D).cuda()
    kw = dict(moe=moe, max_batch=max(args.batch or [1]), **prefill_kw)
    megas = {f"mk_{s}": MegaDecoderLayer(wm, cfg, scheduler=s, **kw) for s in ("static", "dynamic")}
    for item, fields in variants.items():  # same-process A/Bs of DecoderConfig switches
        megas[f"mk_static_{item}"] = MegaDecoderLayer(
            wm, dataclasses.replace(cfg, **fields), scheduler="static", **kw
        )
    if args.idle_ties:
        from cutemk.schedulers import StaticScheduler

        idle = StaticScheduler(ties="idle")
        megas["mk_static_idle_ties"] = MegaDecoderLayer(wm, cfg, scheduler=idle, **kw)
    profiled = None
    if args.trace:  # a separate module: profiling adds a timestamp store per task
        profiled = MegaDecoderLayer(wm, cfg, scheduler="static", **kw)
        profiled.profile = args.trace
    meta = {
        "layer": dims.name,
        "dims": dataclasses.asdict(dims),
        "kv_len": KV,
        "rep": rep,
        "block_n": args.block_n,
        "fold_norms": cfg.fold_norms,
        "attention_align": cfg.attention_align,
        "config": dataclasses.asdict(cfg),
    }
    res = Results("moe_decoder_layer" if dims.experts else "decoder_layer", meta=meta)
    for b in args.batch:
        case = f"decode B={b} KV={KV}"
        x = torch.randn(b, H, device="cuda", generator=gen).bfloat16()
        pos = torch.full((b,), KV - 1, dtype=torch.int32, device="cuda")
        lens = pos + 1
        # the static cache and the same keys and values in pages (sequence-major)
        kc = torch.randn(b, HKV, KV, D, device="cuda", generator=gen).bfloat16()
        vc = torch.randn(b, HKV, KV, D, device="cuda", generator=gen).bfloat16()
        pages = KV // PAGE
        k_pages = kc.permute(0, 2, 1, 3).reshape(b * pages, PAGE, HKV, D).contiguous()
        v_pages = vc.permute(0, 2, 1, 3).reshape(b * pages, PAGE, HKV, D).contiguous()
        table = torch.zeros(b, cfg.max_pages, dtype=torch.int32, device="cuda")
        table[:, :pages] = torch.arange(b * pages, device="cuda", dtype=torch.int32).view(b, pages)
        ref = torch_step(x, pos, kc.clone().float(), vc.clone().float(), w, KV, dims, fp32=True)
        touched = _touched_experts(x, pos, kc.clone().float(), vc.clone().float(), w, KV, dims)
        impls = {
            name: (lambda m=m: m(x, pos, k_pages, v_pages, table, lens))
            for name, m in megas.items()
        }
        if args.live:  # one module's inputs at its max batch, the live batch as device data
            top = kw["max_batch"]

            def rows(t):
                return torch.cat([t, t[:1].expand(top - b, *t.shape[1:])]).contiguous()

            xm, pm, tm, lm = rows(x), rows(pos), rows(table), rows(lens)
            nb = torch.full((1,), b, dtype=torch.int32, device="cuda")
            live_mod = megas["mk_static"]
            impls["mk_static_live"] = lambda: live_mod(
                xm, pm, k_pages, v_pages, tm, lm, num_tokens=nb
            )[:b]
        if profiled is not None:
            records = profile_launch(
                res,
                case,
                lambda: profiled(x, pos, k_pages, v_pages, table, lens),
                profiled.compiled(profiled.regime(b)),
                warmup,
                rep,
            )
            if args.records is not None:
                args.records.mkdir(parents=True, exist_ok=True)
                path = args.records / f"decoder_layer_records_B{b}.json"
                path.write_text(json.dumps(records))
        impls["torch_graph"] = lambda: torch_step(x, pos, kc, vc, w, KV, dims)
        errs = {n: ((f().float() - ref).norm() / ref.norm()).item() for n, f in impls.items()}
        impls["torch_eager"], errs["torch_eager"] = impls["torch_graph"], errs["torch_graph"]
        fl = floor_us(0.0, _weight_bytes(w, dims, touched) + 2.0 * 2 * b * KV * HKV * D)
        if touched is not None:
            res.meta.setdefault("experts_touched", {})[case] = touched
        _time_impls(res, case, impls, errs, fl, warmup, rep, rounds=args.rounds)
    if args.prefill:
        run_prefill(res, megas, w, dims, args.prefill, warmup, rep, gen, profiled)
    res.add_ratios("torch_graph")
    res.finish(chart=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
