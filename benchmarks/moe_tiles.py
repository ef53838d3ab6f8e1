"""Tile sweep of the MoE megakernel (tuning aid): the Qwen3-30B-A3B block of ``moe.py`` built
with each given tile set, static scheduler, CUDA-graph replays, and the per-node trace of the
grouped GEMMs. A tile set is ``BMxBNxDOWN[xcCHUNK][xmCOMBINE]``: gate/up block_m x block_n,
down block_n, then optionally the tokens per routing tile (without it the routing is one task)
and per combine tile.

Run: python benchmarks/moe_tiles.py --tokens 1024 4096 --tiles 128x64x128 128x64x128xc64xm16
"""

from __future__ import annotations

import argparse

import torch
from moe import MAX_ERR, MAX_TOKENS, TOP_K, E, H, I, rel_err

from cutemk.bench import Results, floor_us, graphed, time_us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--tiles", nargs="+", default=["128x64x128"])
    p.add_argument("--scheduler", default="static")
    p.add_argument("--trace", action="store_true", help="also print each case's per-node trace")
    p.add_argument("--export", metavar="DIR", help="with --trace: a Chrome trace per case in DIR")
    args = p.parse_args(argv)
    import cutemk.nn as mknn
    from cutemk.layers import moe_reference
    from cutemk.trace import node_summary

    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    w = {
        "w_router": (torch.randn(E, H, device="cuda", generator=gen) / H**0.5).to(dt),
        "w_gate_up": (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).to(dt),
        "w_down": (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).to(dt),
    }
    res = Results("moe_tiles", meta={"scheduler": args.scheduler, "tiles": args.tiles})
    for tiles in args.tiles:
        bm, bn, dn, *more = tiles.split("x")
        fields = {"block_m": int(bm), "block_n": int(bn), "down_block_n": int(dn)}
        for m in more:  # cNN: tokens per routing tile, mNN: tokens per combine tile
            fields["route_chunk" if m[0] == "c" else "combine_block_m"] = int(m[1:])
        fields.setdefault("route_chunk", None)
        for regime in mknn.MOE_REGIME_LIMITS:  # one tile set for every token count
            mknn.MOE_TILES[("cute", regime)] = dict(mknn.MOE_TILES[("cute", regime)], **fields)
        plain = mknn.MegaMoE(**w, top_k=TOP_K, max_tokens=MAX_TOKENS, scheduler=args.scheduler)
        # profiling adds a timestamp store per task: a separate module, not the timed one
        m = (
            mknn.MegaMoE(
                **w, top_k=TOP_K, max_tokens=MAX_TOKENS, scheduler=args.scheduler, profile=True
            )
            if args.trace
            else None
        )
        for t in args.tokens:
            x = torch.randn(t, H, device="cuda", generator=gen).to(dt)
            ref = moe_reference(x, **w, top_k=TOP_K, router_dtype=dt)
            err = rel_err(plain(x), ref)
            us = time_us(graphed(lambda p=plain, x=x: p(x)), warmup=3, rep=20)
            flops = 2.0 * t * H * E + 2.0 * t * TOP_K * 3 * H * I
            fl = floor_us(flops, 2.0 * (E * 3 * H * I + E * H + 2 * t * H))
            res.add(f"T={t}", tiles, us, floor_us=round(fl, 2), rel_err=round(err, 5))
            if not err <= MAX_ERR:
                print(f"WARNING T={t} {tiles}: rel_err {err:.3g}")
            print(f"T={t} {tiles}: {us:.1f} us")
            if m is None:
                continue
            c = m.compiled(m.regime(t))
            for _ in range(3):
                c(x, *w.values())
            torch.cuda.synchronize()
            if args.export:
                c.export_trace(f"{args.export}/moe_T{t}_{tiles}_{args.scheduler}.json")
            for row in node_summary(c.profile_records()):
                print("   ", row)
    print(res.table())
    res.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
