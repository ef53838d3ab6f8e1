"""Where the host time of an eager megakernel call goes: cProfile of back-to-back eager calls of
a small ``MegaMLP`` (the module path: custom op, regime, plan lookup, launch) and of the
compiled graph it runs (the launch path alone).

Run: python benchmarks/host_overhead_profile.py [--calls N]   (GPU). Prints the host time of each
step of a call, then per path the host time a call and the top functions by own and by
cumulative time; the kernel is tiny and the launch asynchronous, so what shows is Python and
argument marshalling.
"""

import argparse
import cProfile
import pstats

import torch

from cutemk.bench import host_us, small_mlp


def _profile(label: str, fn, calls: int) -> None:
    per_call = host_us(fn, calls)
    print(f"== {label}: {per_call:.1f} us of host time a call (no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)


def breakdown(mlp, x, calls: int) -> None:
    """Host time of each step of an eager call, each timed alone in a loop."""
    from cutemk import torch_ops
    from cutemk.nn import _token_rows

    graph = mlp.compiled(mlp.regime(x.shape[0]), like=mlp.w_down)
    w_gu, w_down = mlp.w_gate_up, mlp.w_down
    graph(x, w_gu, w_down)
    call = graph._calls[(x.shape, w_gu.shape, w_down.shape)]
    b = call.buffers
    tensors = list(call.template)
    for pos, i in call.leaf_slots:
        tensors[pos] = (x, w_gu, w_down)[i]
    out_pos, shape, dtype, _ = call.outputs[0]
    tensors[out_pos] = torch.empty(shape, dtype=dtype, device="cuda")
    fn = graph._fn
    run = graph.runner(x, w_gu, w_down)
    tail = (*b.kernel_args, b.max_epoch, graph.timeout_ns, graph.num_sms)
    steps = {
        "module call (MegaMLP.forward)": lambda: mlp(x),
        "  _token_rows": lambda: _token_rows(mlp, x),
        "  torch_ops.direct": lambda: torch_ops.direct(x),
        "  module.compiled(regime)": lambda: mlp.compiled(mlp.regime(8), like=w_down),
        "  torch.no_grad enter/exit": lambda: torch.no_grad().__enter__(),
        "graph call (CuteGraph.__call__)": lambda: graph(x, w_gu, w_down),
        "  kept runner (CuteGraph.runner)": lambda: run((x, w_gu, w_down)),
        "  _Call.matches": lambda: call.matches((x, w_gu, w_down)),
        "  torch.empty (the output)": lambda: torch.empty(shape, dtype=dtype, device="cuda"),
        "  is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "  compiled kernel call (TVM-FFI + launch)": lambda: fn(tensors, *tail),
        "torch.add (one torch kernel)": lambda: torch.add(x, x),
    }
    raw = getattr(fn, "_tvm_ffi_function", None)
    if raw is not None:
        steps["  the same, TVM-FFI function without its wrapper"] = lambda: raw(tensors, *tail)
    # every tensor converted ahead: what is left is the kernel's host code (its checks, the TMA
    # descriptors it builds inline, the launch)
    import tvm_ffi

    converted = [tvm_ffi.from_dlpack(t) if isinstance(t, torch.Tensor) else t for t in tensors]
    steps["  the same, tensors converted ahead"] = lambda: fn(converted, *tail)
    print(f"== host time of each step ({len(tensors)} tensors in the kernel's tuple)")
    for name, step in steps.items():
        print(f"{name:45s} {host_us(step, calls):7.2f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    mlp, x = small_mlp()
    breakdown(mlp, x, args.calls)
    _profile("MegaMLP eager call", lambda: mlp(x), args.calls)
    graph = mlp.compiled(mlp.regime(8), like=mlp.w_down)
    _profile("compiled graph call", lambda: graph(x, mlp.w_gate_up, mlp.w_down), args.calls)
    a = torch.randn_like(x, dtype=torch.float32)
    _profile("torch.add", lambda: torch.add(a, a), args.calls)


if __name__ == "__main__":
    main()
