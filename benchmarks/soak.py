"""Soak: many back-to-back launches of one compiled MoE megakernel and one MLP megakernel,
alternating token counts, with no reset in between.

The first launch at each token count is checked against the fp32 torch reference; every later
launch at that count must be bit-identical to it (the megakernels use no atomics in their data
path). Reports wall time, launches per second and every mismatch; writes
``benchmarks/results/soak.json``. Exits non-zero on any mismatch or error.

Run: python benchmarks/soak.py [--launches 10000] [--scheduler static]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from cutemk.bench import Results

TOKENS = (1, 7, 64, 129, 500, 1000, 33, 2048)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=10000)
    p.add_argument("--scheduler", default="static")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    import cutemk as mk
    from cutemk.layers import MoeConfig, mlp_graph, mlp_reference, moe_graph, moe_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    max_t = max(TOKENS)
    moe_cfg = MoeConfig(512, 256, 16, 4, block_m=64, block_n=64, down_block_n=128)
    moe_w = {
        "w_router": rnd(16, 512),
        "w_gate_up": rnd(16, 512, 512, scale=512**-0.5),
        "w_down": rnd(16, 512, 256, scale=256**-0.5),
    }
    mlp_w = {"w_gate_up": rnd(1024, 512, scale=512**-0.5), "w_down": rnd(512, 512, scale=512**-0.5)}
    layers = {
        "moe": (
            moe_graph(mk.sym("T", max=max_t), moe_cfg, dt),
            moe_w,
            lambda x: moe_reference(x, **moe_w, top_k=4),
        ),
        "mlp": (
            mlp_graph(mk.sym("T", max=max_t), 512, 512, dt, block_m=64, block_n=64, fuse_silu=True),
            mlp_w,
            lambda x: mlp_reference(x, **mlp_w),
        ),
    }
    compiled = {
        name: g.compile("cute", scheduler=args.scheduler, watchdog=True)
        for name, (g, _, _) in layers.items()
    }
    xs = {t: rnd(t, 512) for t in TOKENS}
    first: dict[tuple[str, int], torch.Tensor] = {}
    mismatches: list[str] = []
    for name, (_, w, ref_fn) in layers.items():  # the first launch at each count, vs torch
        for t in TOKENS:
            y = compiled[name](xs[t], **w).clone()
            ref = ref_fn(xs[t])
            err = ((y.float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                mismatches.append(f"{name} T={t}: rel err {err:.3g} vs torch")
            first[(name, t)] = y
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.launches):
        name = "moe" if i % 2 == 0 else "mlp"
        t = TOKENS[(i // 2) % len(TOKENS)]
        y = compiled[name](xs[t], **layers[name][1])
        if not torch.equal(y, first[(name, t)]):
            mismatches.append(f"launch {i}: {name} T={t} differs from its first launch")
            if len(mismatches) > 20:
                break
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    res = Results(
        "soak",
        meta={
            "launches": args.launches,
            "scheduler": args.scheduler,
            "tokens": list(TOKENS),
            "layers": "MoE E=16 top-4 H=512 I=256; MLP H=512 I=512; bf16, max T 2048",
            "mismatches": mismatches,
            "wall_s": round(wall, 3),
        },
    )
    res.add("soak", "cutemk", 1e6 * wall / max(args.launches, 1), launches=args.launches)
    res.finish()
    print(
        f"{args.launches} launches ({args.scheduler}) in {wall:.2f} s "
        f"({args.launches / wall:.0f}/s, {1e6 * wall / args.launches:.1f} us each, eager calls "
        f"with an equality check each); mismatches: {len(mismatches)}"
    )
    for m in mismatches:
        print("  ", m)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
