import cProfile, pstats, torch, cutemk as mk
from cutemk.layers import mlp_graph

g = mlp_graph(mk.sym("T", max=512), 256, 192, torch.bfloat16, 64, 64)
c = g.compile("cute", scheduler="static")
x = torch.randn(64, 256, device="cuda").bfloat16()
a = torch.randn(384, 256, device="cuda").bfloat16()
b = torch.randn(256, 192, device="cuda").bfloat16()
for _ in range(20):
    c(x, a, b)
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    c(x, a, b)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
