"""Decode attention (GQA 32 query / 8 KV heads, head dim 128, bf16): cutemk's paged split-KV
megakernel (``ops.attention_decode``: split-KV tiles, the last range merges) vs torch SDPA over a
contiguous KV cache and FlashAttention-4 (``flash_attn.cute``) where importable, all in one
process, CUDA-graph replays.

Columns: median_us, floor_us = bytes of K, V, q and out / 4.3 TB/s, of_floor, rel_err against
an fp32 reference, and ``speedup_vs_sdpa``. cutemk's KV pages are scattered through the cache
(a page table as vLLM / FlashInfer keep it); SDPA and FA4 read a contiguous cache.

One cutemk graph (page tables of the longest case's capacity) serves every case: each
sequence is split into a share of its live length per tile (``ops.kv_split``).

``--prefill``: causal prefill instead (``ops.attention_prefill``, new tokens after a cached
prefix or none) vs SDPA (a mask aligning the new tokens to the cache's end) and FA4 (causal),
results/attention_prefill.json; rel_err against SDPA; floor from the causal FLOPs at 790 TFLOP/s.

``--one-pass``: also the one-pass merge of the ranges (the default is the two-step merge
wherever the Hopper tile takes it).

``--wide`` with ``--prefill``: also the tile of the other step (``ops.attention_prefill``'s
``step``: 64 keys a ring slot, or 128 with K and V in a slot each), as ``cutemk_step<N>``.

``--trace slices`` with ``--prefill``: also where a tile's step (64 or 128 keys) spends its cycles
(``phase_cycles`` in the slice summary, medians over the slices of the first consumer thread:
the loop top, the wait for the tensor cores' turn, the S wgmma, mask and softmax, the wait
for the previous P V).

Run: python benchmarks/attention.py [--splits 16] [--target-tiles 264] [--quick] [--prefill]
[--one-pass] [--wide] [--trace [slices]]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from cutemk.bench import (
    Results,
    add_trace_argument,
    floor_us,
    graphed,
    profile_launch,
    time_us,
)

HQ, HKV, D, PAGE = 32, 8, 128, 16
CASES = ((1, 8192), (1, 32768), (16, 8192), (64, 4096))  # (batch, KV length)
MAX_B = 64
PREFILL_CASES = ((1, 8192, 0), (4, 2048, 0), (1, 1024, 4096))  # (batch, new tokens, cached)


def _graph(splits: int, target_tiles: int, align: int, max_len: int, merge_batched=None):
    import cutemk as mk
    from cutemk import ops

    g = mk.Graph("decode_attention")
    B = mk.sym("B", min=1, max=MAX_B)
    dt = torch.bfloat16
    q = g.input("q", (B, HQ, D), dt)
    k = g.input("k_cache", (mk.sym("P", min=1, max=1 << 20), PAGE, HKV, D), dt)
    v = g.input("v_cache", (k.spec.shape[0], PAGE, HKV, D), dt)
    pt = g.input("page_table", (B, max_len // PAGE), torch.int32)
    lens = g.input("seq_lens", (B,), torch.int32)
    out = g.call(
        ops.attention_decode,
        q,
        k,
        v,
        pt,
        lens,
        splits=splits,
        target_tiles=target_tiles,
        align=align,
        merge_batched=merge_batched,
    )[0]
    g.output(out, "out")
    return g


def _prefill_graph(max_len: int, max_tokens: int, step: int | None = None):
    import cutemk as mk
    from cutemk import ops

    g = mk.Graph("prefill_attention")
    B = mk.sym("B", min=1, max=MAX_B)
    T = mk.sym("T", min=1, max=max_tokens)
    dt = torch.bfloat16
    q = g.input("q", (T, HQ, D), dt)
    k = g.input("k_cache", (mk.sym("P", min=1, max=1 << 20), PAGE, HKV, D), dt)
    v = g.input("v_cache", (k.spec.shape[0], PAGE, HKV, D), dt)
    pt = g.input("page_table", (B, max_len // PAGE), torch.int32)
    lens = g.input("seq_lens", (B,), torch.int32)
    cu = g.input("cu_seqlens", (B + 1,), torch.int32)
    g.output(g.call(ops.attention_prefill, q, k, v, pt, lens, cu, step=step), "out")
    return g


def run_prefill(args, warmup: int, rep: int) -> int:
    """Causal prefill cases: cutemk vs SDPA and FA4, one process."""
    max_len = max(n + c for _, n, c in PREFILL_CASES)
    max_t = max(b * n for b, n, _ in PREFILL_CASES)
    mk_attn = _prefill_graph(max_len, max_t).compile("cute", scheduler=args.scheduler)
    wide = None
    if args.wide:  # the other step, same process
        other = 128 if mk_attn.graph.nodes[0].op.step == 64 else 64
        wide = _prefill_graph(max_len, max_t, other).compile("cute", scheduler=args.scheduler)
    profiled = None
    if args.trace:  # a graph of its own: profiling adds a timestamp store per task
        profiled = _prefill_graph(max_len, max_t).compile(
            "cute", scheduler=args.scheduler, profile=args.trace
        )
    fa4 = _fa4()
    res = Results(
        "attention_prefill",
        meta={
            "dtype": "bf16",
            "heads": f"{HQ} query / {HKV} KV, head dim {D}",
            "page_size": PAGE,
            "scheduler": args.scheduler,
            "rep": rep,
            "step": mk_attn.graph.nodes[0].op.step,
        },
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, n, cached in PREFILL_CASES:
        case = f"prefill B={b} new={n} cached={cached}"
        length = n + cached
        per_seq = -(-length // PAGE)
        perm = torch.randperm(b * per_seq, device="cuda", generator=gen).to(torch.int32)
        table = torch.zeros(b, max_len // PAGE, dtype=torch.int32, device="cuda")
        table[:, :per_seq] = perm.view(b, per_seq)
        kc = torch.randn(b * per_seq, PAGE, HKV, D, device="cuda", generator=gen).bfloat16()
        vc = torch.randn(b * per_seq, PAGE, HKV, D, device="cuda", generator=gen).bfloat16()
        q = torch.randn(b * n, HQ, D, device="cuda", generator=gen).bfloat16()
        lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
        cu = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * n
        idx = table[:, :per_seq].long()
        k_flat = kc[idx].reshape(b, per_seq * PAGE, HKV, D)[:, :length]
        v_flat = vc[idx].reshape(b, per_seq * PAGE, HKV, D)[:, :length]
        # new token i sits at position cached + i and sees the keys up to it
        mask = torch.arange(length, device="cuda")[None, :] <= (
            cached + torch.arange(n, device="cuda")[:, None]
        )

        def sdpa():
            return (
                F.scaled_dot_product_attention(
                    q.view(b, n, HQ, D).transpose(1, 2),
                    k_flat.transpose(1, 2),
                    v_flat.transpose(1, 2),
                    attn_mask=None if cached == 0 else mask,
                    is_causal=cached == 0,
                    enable_gqa=True,
                )
                .transpose(1, 2)
                .reshape(b * n, HQ * D)
            )

        impls = {
            "cutemk": lambda: mk_attn(q, kc, vc, table, lens, cu),
            "torch_sdpa": sdpa,
        }
        if wide is not None:
            impls[f"cutemk_step{wide.graph.nodes[0].op.step}"] = lambda: wide(
                q, kc, vc, table, lens, cu
            )
        if fa4 is not None:
            impls["fa4"] = lambda: fa4(q.view(b, n, HQ, D), k_flat, v_flat, causal=True)[0].reshape(
                b * n, HQ * D
            )
        ref = sdpa().float()
        flops = 4.0 * b * HQ * D * (n * cached + n * (n + 1) / 2)
        fl = floor_us(flops, 2.0 * (2 * b * length * HKV * D + 2 * b * n * HQ * D))
        _time_impls(res, case, impls, ref, fl, warmup, rep, flops=flops, err_key="rel_err_vs_sdpa")
        if profiled is not None:
            run = lambda: profiled(q, kc, vc, table, lens, cu)
            records = profile_launch(res, case, run, profiled, warmup, rep)
            # a tile streams ceil(keys / 64) slices: the busy time per slice
            qb = 128 // (HQ // HKV)
            slices = HKV * sum(
                -(-(cached + min((k + 1) * qb, n)) // 64)
                for _ in range(b)
                for k in range(-(-n // qb))
            )
            busy = sum(r["end_ns"] - r["start_ns"] for r in records) / 1e3
            res.meta["trace"][f"{case} launch"]["us_per_slice"] = round(busy / slices, 3)
            print(f"    {slices} slices, {busy / slices:.3f} us of a tile's time per slice")
    res.add_ratios("torch_sdpa")
    if fa4 is not None:
        res.add_ratios("fa4")
    res.finish(chart=True)
    return 0


def _time_impls(res, case, impls, ref, fl, warmup, rep, flops=None, err_key="rel_err"):
    """Each of ``impls`` checked against ``ref`` and timed (CUDA-graph replays) into a row of
    ``res``, with its share of the floor ``fl`` (and TFLOP/s given ``flops``); a peer failing
    a case is reported in the JSON, not fatal."""
    for name, fn in impls.items():
        try:
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            us = time_us(graphed(fn), warmup=warmup, rep=rep)
        except Exception as e:  # noqa: BLE001  (a peer failing one case is reported)
            res.meta.setdefault("skipped", []).append(f"{case} {name}: {e}")
            print(f"{case} {name} skipped: {e}")
            continue
        res.add_timed(case, name, us, fl, flops, **{err_key: round(err, 5)})


def _fa4():
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as e:  # noqa: BLE001  (the peer is optional)
        print(f"flash_attn.cute skipped: {e}")
        return None
    return flash_attn_func


def main(argv=None) -> int:
    global PAGE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--splits", type=int, default=16, help="most KV ranges a sequence")
    p.add_argument("--target-tiles", type=int, default=264, help="tiles the split aims for")
    p.add_argument("--align", type=int, default=64, help="tokens a range is a multiple of")
    p.add_argument("--quick", action="store_true", help="3 warm-up, 10 timed runs")
    p.add_argument("--scheduler", default="static")
    p.add_argument("--prefill", action="store_true", help="causal prefill cases instead")
    add_trace_argument(p, "per case, the tiles' summary")
    p.add_argument("--page", type=int, default=PAGE, help="tokens a KV-cache page")
    p.add_argument(
        "--wide",
        action="store_true",
        help="with --prefill: also the tile of the other step (64 / 128 keys, "
        "CUTEMK_PREFILL_STEP), same process",
    )
    p.add_argument(
        "--one-pass",
        action="store_true",
        help="also time the one-pass merge of the ranges (cutemk_one_pass, same process; the "
        "default is the two-step merge wherever the Hopper tile takes it)",
    )
    args = p.parse_args(argv)
    PAGE = args.page
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.prefill:
        return run_prefill(args, *((3, 10) if args.quick else (10, 50)))
    from cutemk.ops.attention_decode import decode_attention_reference

    warmup, rep = (3, 10) if args.quick else (10, 50)
    max_len = max(n for _, n in CASES)
    mk_attn = _graph(args.splits, args.target_tiles, args.align, max_len).compile(
        "cute", scheduler=args.scheduler
    )
    profiled = None
    if args.trace:  # a graph of its own: profiling adds a timestamp store per task
        profiled = _graph(args.splits, args.target_tiles, args.align, max_len).compile(
            "cute", scheduler=args.scheduler, profile=args.trace
        )
    one_pass = None
    if args.one_pass:
        one_pass = _graph(args.splits, args.target_tiles, args.align, max_len, False).compile(
            "cute", scheduler=args.scheduler
        )
    fa4 = _fa4()
    res = Results(
        "attention",
        meta={
            "dtype": "bf16",
            "heads": f"{HQ} query / {HKV} KV, head dim {D}",
            "page_size": PAGE,
            "splits": args.splits,
            "target_tiles": args.target_tiles,
            "align": args.align,
            "page_table_tokens": max_len,
            "scheduler": args.scheduler,
            "rep": rep,
            "cutemk_merge": "two-step" if mk_attn.graph.nodes[0].op.batched_merge else "one-pass",
        },
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, n in CASES:
        case = f"decode B={b} KV={n}"
        pages = b * (n // PAGE)
        perm = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)
        table = torch.zeros(b, max_len // PAGE, dtype=torch.int32, device="cuda")
        table[:, : n // PAGE] = perm.view(b, n // PAGE)
        kc = torch.randn(pages, PAGE, HKV, D, device="cuda", generator=gen).bfloat16()
        vc = torch.randn(pages, PAGE, HKV, D, device="cuda", generator=gen).bfloat16()
        q = torch.randn(b, HQ, D, device="cuda", generator=gen).bfloat16()
        lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
        # the same keys and values, contiguous per sequence, for SDPA and FA4
        k_flat = kc[table[:, : n // PAGE].long()].reshape(b, n, HKV, D)
        v_flat = vc[table[:, : n // PAGE].long()].reshape(b, n, HKV, D)
        ref = decode_attention_reference(q, kc, vc, table, lens)
        impls = {
            "cutemk": lambda mk_attn=mk_attn: mk_attn(q, kc, vc, table, lens),
            "torch_sdpa": lambda: F.scaled_dot_product_attention(
                q.unsqueeze(2),
                k_flat.transpose(1, 2),
                v_flat.transpose(1, 2),
                enable_gqa=True,
            ).reshape(b, HQ * D),
        }
        if one_pass is not None:
            impls["cutemk_one_pass"] = lambda: one_pass(q, kc, vc, table, lens)
        if fa4 is not None:
            impls["fa4"] = lambda: fa4(q.unsqueeze(1), k_flat, v_flat)[0].reshape(b, HQ * D)
        nbytes = 2.0 * (2 * b * n * HKV * D + 2 * b * HQ * D)
        fl = floor_us(4.0 * b * HQ * n * D, nbytes)
        _time_impls(res, case, impls, ref, fl, warmup, rep)
        if profiled is not None:
            run = lambda: profiled(q, kc, vc, table, lens)
            records = profile_launch(res, case, run, profiled, warmup, rep)
            spans = sorted((r["end_ns"] - r["start_ns"]) / 1e3 for r in records)
            t0 = min(r["start_ns"] for r in records)
            print(
                f"    {len(records)} tiles: {spans[len(spans) // 2]:.2f} us median, "
                f"{spans[-1]:.2f} max; span {(max(r['end_ns'] for r in records) - t0) / 1e3:.2f}"
                f" us, last start {(max(r['start_ns'] for r in records) - t0) / 1e3:.2f}"
            )
    res.add_ratios("torch_sdpa")
    res.finish(chart=not args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
