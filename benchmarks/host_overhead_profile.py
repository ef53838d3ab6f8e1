"""Where the host time of an eager megakernel call goes: cProfile of back-to-back eager calls of
a small ``MegaMLP`` (the module path: custom op, regime, plan lookup, launch) and of the
compiled graph it runs (the launch path alone).

Run: python benchmarks/host_overhead_profile.py [--calls N]   (GPU). Prints the wall time per
call and the top functions by own and by cumulative time; the kernel is tiny and the launch
asynchronous, so what shows is Python and argument marshalling.
"""

import argparse
import cProfile
import pstats
import time

import torch


def _profile(label: str, fn, calls: int) -> None:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    per_call = 1e6 * (time.perf_counter() - t0) / calls
    print(f"== {label}: {per_call:.1f} us a call (wall, back to back, no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    from cutemk.nn import MegaMLP

    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i = 256, 512

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) / shape[-1] ** 0.5).bfloat16()

    mlp = MegaMLP(rnd(i, h), rnd(i, h), rnd(h, i), max_tokens=64)
    x = torch.randn(8, h, device="cuda", generator=gen).bfloat16()
    _profile("MegaMLP eager call", lambda: mlp(x), args.calls)
    graph = mlp.compiled(mlp.regime(8), like=mlp.w_down)
    _profile("compiled graph call", lambda: graph(x, mlp.w_gate_up, mlp.w_down), args.calls)
    a = torch.randn(8, h, device="cuda")
    _profile("torch.add", lambda: torch.add(a, a), args.calls)


if __name__ == "__main__":
    main()
