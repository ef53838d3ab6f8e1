"""Time to the first launch of a small Qwen3-MoE megakernel in a fresh process: run twice to see
the on-disk kernel cache (``cutemk.kernels.kernel_cache_dir``) at work: the first process
compiles and stores the kernel, the second loads it.

Run: python benchmarks/compile_cache_probe.py   (GPU)
"""

import time

import torch

import cutemk as mk
from cutemk import runtime
from cutemk.layers import MoeConfig, moe_graph

cfg = MoeConfig(hidden=128, intermediate=64, num_experts=8, top_k=2, block_m=16, block_n=64)
g = moe_graph(mk.sym("T", max=512), cfg)
c = g.compile("cute", scheduler="dynamic")
w = dict(
    w_router=torch.randn(8, 128, device="cuda"),
    w_gate_up=torch.randn(8, 128, 128, device="cuda"),
    w_down=torch.randn(8, 128, 64, device="cuda"),
)
t0 = time.perf_counter()
c(torch.randn(5, 128, device="cuda"), **w)
torch.cuda.synchronize()
print(
    f"first launch (trace + compile or cache load): {time.perf_counter() - t0:.2f} s, "
    f"compiled by this process: {runtime.compile_count}, loaded from the cache: "
    f"{runtime.cache_loads}"
)
