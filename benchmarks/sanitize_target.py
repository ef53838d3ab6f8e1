"""One small MoE or MLP megakernel launch per scheduler, checked against torch: a target for
``compute-sanitizer`` (memcheck / racecheck), which slows every access, so the layers are small.

Targets: ``moe`` (routed, 37 tokens), ``moe_slots`` (the slot layout at 2 tokens, the combine
in the down tiles: their partial rows and counters), ``mlp``.

Run: compute-sanitizer --tool memcheck python benchmarks/sanitize_target.py moe [static|dynamic]
(both schedulers unless one is named).
"""

from __future__ import annotations

import sys

import torch


def main(argv=None) -> int:
    args = argv or sys.argv[1:] or ["moe"]
    which = args[0]
    schedulers = args[1:] or ["static", "dynamic"]
    import cutemk as mk
    from cutemk.layers import MoeConfig, mlp_graph, mlp_reference, moe_graph, moe_reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    t_sym, t = mk.sym("T", max=256), 37
    if which.startswith("moe"):
        tiles = dict(block_m=64, block_n=64, down_block_n=128)
        if which == "moe_slots":
            t_sym, t = mk.sym("T", max=2), 2
            tiles.update(slots=True, fused_combine=True)
        else:
            tiles.update(route_chunk=8)
        cfg = MoeConfig(256, 128, 8, 2, **tiles)
        w = {
            "w_router": rnd(8, 256),
            "w_gate_up": rnd(8, 256, 256, scale=256**-0.5),
            "w_down": rnd(8, 256, 128, scale=128**-0.5),
        }
        g, ref_fn = moe_graph(t_sym, cfg, dt), lambda x: moe_reference(x, **w, top_k=2)
    else:
        w = {"w_gate_up": rnd(512, 256, scale=256**-0.5), "w_down": rnd(256, 256, scale=256**-0.5)}
        g = mlp_graph(t_sym, 256, 256, dt, block_m=64, block_n=64, fuse_silu=True)
        ref_fn = lambda x: mlp_reference(x, **w)  # noqa: E731
    x = rnd(t, 256)
    ok = True
    for scheduler in schedulers:
        y = g.compile("cute", scheduler=scheduler, poison_outputs=True)(x, **w)
        ref = ref_fn(x)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        print(f"{which} {scheduler} T={t}: rel err {err:.2e}")
        ok &= err < 2e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
