"""Where the host time of an eager megakernel call goes: cProfile of 200 calls of a small MLP.

Run: python benchmarks/host_overhead_profile.py   (GPU). Prints the top functions by cumulative
time; the launch itself is asynchronous, so what shows is Python and argument marshalling.
"""

import cProfile
import pstats

import torch

import cutemk as mk
from cutemk.layers import mlp_graph

g = mlp_graph(mk.sym("T", max=512), 256, 192, torch.bfloat16, 64, 64)
c = g.compile("cute", scheduler="static")
x = torch.randn(64, 256, device="cuda").bfloat16()
w_gate_up = torch.randn(384, 256, device="cuda").bfloat16()
w_down = torch.randn(256, 192, device="cuda").bfloat16()
for _ in range(20):
    c(x, w_gate_up, w_down)
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(200):
    c(x, w_gate_up, w_down)
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
