"""One decode step of a Qwen3-8B decoder layer (H=4096, I=12288, 32 query / 8 KV heads, head
dim 128, bf16) with every sequence at KV length 4096: ``cutemk.nn.MegaDecoderLayer`` (one
megakernel, paged KV cache) vs the same layer in plain torch (cuBLAS GEMMs, SDPA, a static
contiguous KV cache, in-place cache writes), eager and under a CUDA graph, in one process.

Columns: median_us, floor_us = (layer weights + the KV cache read) / 4.3 TB/s, of_floor,
rel_err against an fp32 torch step, ``speedup_vs_torch_graph``.

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
``qk_norm_rope`` appends, no ``kv_append``), timed in the same process. ``--set
FIELD=VALUE``: change the layer's config for every module (the traced one too), for a
separate-process A/B with a trace.

``--prefill 2048``: also prefill steps (one sequence of that many new tokens, no cached prefix)
as one megakernel (``MegaDecoderLayer.prefill``, 128 x 128 GEMM tiles) vs the same layer in torch
(cuBLAS, causal SDPA), eager and under a CUDA graph; ``--batch`` with no count runs only those.
With ``--trace`` the prefill steps are traced too.

Run: python benchmarks/decoder_layer.py [--batch 1 16 64] [--quick] [--trace [slices]
[--records DIR]]
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

H, I, HQ, HKV, D = 4096, 12288, 32, 8, 128
KV, PAGE, EPS = 4096, 16, 1e-6


def _weights(gen):
    dt = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    from cutemk.ops import rope_table

    return {
        "input_norm": 1 + rnd(H, scale=0.1),
        "w_qkv": rnd((HQ + 2 * HKV) * D, H, scale=H**-0.5),
        "q_norm": 1 + rnd(D, scale=0.1),
        "k_norm": 1 + rnd(D, scale=0.1),
        "cos_sin": rope_table(KV + 1, D).cuda(),
        "w_o": rnd(H, HQ * D, scale=(HQ * D) ** -0.5),
        "post_norm": 1 + rnd(H, scale=0.1),
        "w_gate_up": rnd(2 * I, H, scale=H**-0.5),
        "w_down": rnd(H, I, scale=I**-0.5),
    }


def torch_step(x, pos, kc, vc, w, n, fp32=False):
    """The decode step in torch on a static cache kc / vc (B, Hkv, L, D), written in place at
    ``pos``; attention over the first ``n`` positions (every sequence at length n, a Python int:
    no device sync, so the step captures in a CUDA graph). ``fp32``: every operand in fp32."""
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
    gu = h2 @ w["w_gate_up"].T
    return h1 + (F.silu(gu[:, :I]) * gu[:, I:]) @ w["w_down"].T


def torch_prefill(x, kc, vc, w, fp32=False):
    """A prefill step of one sequence of T new tokens (no cached prefix) in torch on a static
    cache kc / vc (1, Hkv, L, D), written in place at positions 0..T-1; causal SDPA."""
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
    gu = h2 @ w["w_gate_up"].T
    return h1 + (F.silu(gu[:, :I]) * gu[:, I:]) @ w["w_down"].T


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


def run_prefill(res, megas, w, tokens, warmup, rep, gen, profiled=None) -> None:
    """Prefill steps of one sequence of ``tokens`` new tokens: the layer as one megakernel
    (``MegaDecoderLayer.prefill``) vs the same layer in torch, eager and under a CUDA graph;
    with ``profiled`` (a module with ``profile`` set) the per-node trace of a step too."""
    weight_bytes = 2.0 * sum(t.numel() for k, t in w.items() if k != "cos_sin")
    params = sum(w[k].numel() for k in ("w_qkv", "w_o", "w_gate_up", "w_down"))
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
        ref = torch_prefill(x, kc.clone().float(), vc.clone().float(), w, fp32=True)
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
        impls["torch_graph"] = lambda: torch_prefill(x, kc, vc, w)
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
        metavar="FIELD[=INT]",
        help="also a static module with this DecoderConfig field set (a switch: on, or =0)",
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
        "--attention-align", type=int, default=None, help="tokens per attention slice (64, 128)"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from cutemk.layers import DecoderConfig, fold_decoder_norms
    from cutemk.nn import MegaDecoderLayer

    warmup, rep = (3, 10) if args.quick else (10, 50)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = _weights(gen)
    cfg = DecoderConfig(
        hidden=H,
        intermediate=I,
        heads=HQ,
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
    variants = {item: _config_fields(p, cfg, [item]) for item in args.ab}
    wm = dict(w)  # the megakernel's weights: the norms folded in, as MegaDecoderLayer.from_hf
    if cfg.fold_norms:
        wm = fold_decoder_norms(wm)
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
    megas = {
        f"mk_{s}": MegaDecoderLayer(
            wm, cfg, max_batch=max(args.batch or [1]), scheduler=s, **prefill_kw
        )
        for s in ("static", "dynamic")
    }
    for item, fields in variants.items():  # same-process A/Bs of DecoderConfig switches
        megas[f"mk_static_{item}"] = MegaDecoderLayer(
            wm,
            dataclasses.replace(cfg, **fields),
            max_batch=max(args.batch or [1]),
            scheduler="static",
            **prefill_kw,
        )
    profiled = None
    if args.trace:  # a separate module: profiling adds a timestamp store per task
        profiled = MegaDecoderLayer(
            wm, cfg, max_batch=max(args.batch or [1]), scheduler="static", **prefill_kw
        )
        profiled.profile = args.trace
    meta = {
        "layer": "Qwen3-8B",
        "kv_len": KV,
        "rep": rep,
        "block_n": args.block_n,
        "fold_norms": cfg.fold_norms,
        "attention_align": cfg.attention_align,
        "config": dataclasses.asdict(cfg),
    }
    res = Results("decoder_layer", meta=meta)
    weight_bytes = 2.0 * sum(t.numel() for k, t in w.items() if k != "cos_sin")
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
        ref = torch_step(x, pos, kc.clone().float(), vc.clone().float(), w, KV, fp32=True)
        impls = {
            name: (lambda m=m: m(x, pos, k_pages, v_pages, table, lens))
            for name, m in megas.items()
        }
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
        impls["torch_graph"] = lambda: torch_step(x, pos, kc, vc, w, KV)
        errs = {n: ((f().float() - ref).norm() / ref.norm()).item() for n, f in impls.items()}
        impls["torch_eager"], errs["torch_eager"] = impls["torch_graph"], errs["torch_graph"]
        fl = floor_us(0.0, weight_bytes + 2.0 * 2 * b * KV * HKV * D)
        _time_impls(res, case, impls, errs, fl, warmup, rep, rounds=args.rounds)
    if args.prefill:
        run_prefill(res, megas, w, args.prefill, warmup, rep, gen, profiled)
    res.add_ratios("torch_graph")
    res.finish(chart=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
