"""Qwen3 layers through the megakernel on the GPU, against fp32 torch references."""

import json

import pytest
import torch

import cutemk as mk
from cutemk import runtime
from cutemk.layers import MoeConfig, mlp_graph, mlp_reference, moe_graph, moe_reference
from cutemk.trace import launch_summary, node_summary, slice_summary

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("fuse", [False, True])
def test_mlp(dtype, scheduler, fuse):
    g = mlp_graph(
        mk.sym("T", max=512),
        hidden=256,
        intermediate=192,
        dtype=dtype,
        block_m=64,
        block_n=64,
        fuse_silu=fuse,
    )
    c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    for t in (1, 7, 64, 300):
        x = torch.randn(t, 256, device="cuda").to(dtype)
        wgu = (torch.randn(384, 256, device="cuda") / 16).to(dtype)
        wd = (torch.randn(256, 192, device="cuda") / 14).to(dtype)
        assert rel_err(c(x, wgu, wd), mlp_reference(x, wgu, wd)) < TOL[dtype], f"T={t}"


def test_one_compile_for_every_token_count():
    g = mlp_graph(
        mk.sym("T", max=128),
        hidden=128,
        intermediate=64,
        dtype=torch.bfloat16,
        block_m=32,
        block_n=64,
    )
    c = g.compile("cute", scheduler="static")
    wgu = (torch.randn(128, 128, device="cuda") / 11).bfloat16()
    wd = (torch.randn(128, 64, device="cuda") / 8).bfloat16()
    before = runtime.compile_count
    for t in range(1, 129):
        x = torch.randn(t, 128, device="cuda").bfloat16()
        assert rel_err(c(x, wgu, wd), mlp_reference(x, wgu, wd)) < 1e-2, f"T={t}"
    assert runtime.compile_count - before <= 1  # one kernel, 128 token counts
    with pytest.raises(mk.ShapeError, match="exceeds its declared max 128"):
        c(torch.randn(129, 128, device="cuda").bfloat16(), wgu, wd)
    with pytest.raises(mk.DeviceError, match="must be on a cuda device"):
        c(torch.randn(4, 128).bfloat16(), wgu, wd)


CFG = MoeConfig(hidden=128, intermediate=64, num_experts=8, top_k=2, block_m=16, block_n=64)


def moe_weights(cfg, dtype):
    e, h, i = cfg.num_experts, cfg.hidden, cfg.intermediate
    return dict(
        w_router=torch.randn(e, h, device="cuda").to(dtype),
        w_gate_up=(torch.randn(e, 2 * i, h, device="cuda") / h**0.5).to(dtype),
        w_down=(torch.randn(e, h, i, device="cuda") / i**0.5).to(dtype),
    )


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_moe_data_dependent(scheduler):
    g = moe_graph(mk.sym("T", max=512), CFG)
    c = g.compile("cute", scheduler=scheduler, watchdog=True, poison_outputs=True)
    w = moe_weights(CFG, torch.float32)
    for t in (1, 7, 64, 300):
        x = torch.randn(t, CFG.hidden, device="cuda")
        assert rel_err(c(x, **w), moe_reference(x, **w, top_k=CFG.top_k)) < 1e-4, f"T={t}"
    # all tokens to expert 3, none to expert 5
    w["w_router"][:, 0] = 0.0
    w["w_router"][3, 0] = 25.0
    w["w_router"][5, 0] = -25.0
    for t in (7, 300):
        x = torch.randn(t, CFG.hidden, device="cuda")
        x[:, 0] = 4.0
        assert rel_err(c(x, **w), moe_reference(x, **w, top_k=CFG.top_k)) < 1e-4, f"T={t}"


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_profile_trace(tmp_path, scheduler):
    g = mlp_graph(
        mk.sym("T", max=512),
        hidden=512,
        intermediate=384,
        dtype=torch.bfloat16,
        block_m=64,
        block_n=64,
    )
    c = g.compile("cute", scheduler=scheduler, profile="slices")
    x = torch.randn(256, 512, device="cuda").bfloat16()
    c(
        x,
        torch.randn(768, 512, device="cuda").bfloat16(),
        torch.randn(512, 384, device="cuda").bfloat16(),
    )
    torch.cuda.synchronize()
    recs = c.profile_records()
    assert len(recs) == c.plan({"T": 256}).num_tasks
    assert all(r["end_ns"] >= r["start_ns"] > 0 for r in recs)
    # the phases (cutemk.trace.PHASES): every task was taken up, its early loads armed, its
    # events met, then it started (a dynamic task is ready when popped); a GEMM tile's
    # (gemm0, gemm1) first slice was found landed after its start, its output staged, stored
    for r in recs:
        assert 0 < r["fetched_ns"] <= r["armed_ns"] <= r["ready_ns"] <= r["start_ns"], r
        if r["node"].startswith("gemm"):
            assert r["start_ns"] <= r["landed_ns"] <= r["staged_ns"] <= r["end_ns"], r
    streamed = {row["node"] for row in node_summary(recs) if "median_stream_us" in row}
    assert streamed == {"gemm0", "gemm1"}
    # profile="slices": every GEMM tile's slices, each issued then landed, issued in order
    per_task = c.profile_slices()
    ring = {n.name: n.op.ring_tile().slices for n in g.nodes if n.op.ring_tile() is not None}
    tiles = [r for r in recs if r["node"] in ring]
    assert len(per_task) == len(tiles)
    for t in per_task:
        sl = t["slices"]
        assert len(sl) == ring[t["node"]], t
        assert all(0 < a <= b for a, b in sl), t
        assert [a for a, _ in sl] == sorted(a for a, _ in sl), t
    assert {r["node"] for r in slice_summary(per_task)} == {"gemm0", "gemm1"}
    issued = sum(c["slices"] for c in c.profile_ctas())  # every CTA counted what it issued
    assert issued == sum(len(t["slices"]) for t in per_task)
    doc = json.loads(c.export_trace(tmp_path / "mlp.trace.json").read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(recs) and len({e["tid"] for e in spans}) > 1
    ctas = c.profile_ctas()  # every CTA: entered before its tasks, left after them
    assert len(ctas) == c.num_sms
    first = {}
    for r in recs:
        first[r["sm"]] = min(first.get(r["sm"], r["start_ns"]), r["start_ns"])
    alone = {sm for sm in first if sum(cta["sm"] == sm for cta in ctas) == 1}
    for cta in ctas:
        if cta["sm"] in alone:  # the SM's first task is this CTA's
            assert 0 < cta["entry_ns"] <= first[cta["sm"]]
        assert 0 < cta["entry_ns"] <= cta["roles_done_ns"] <= cta["exit_ns"]
    summary = launch_summary(recs, ctas, c.num_sms)
    assert summary["ctas"] == c.num_sms and 0 < summary["sm_busy_share"] <= 1
    assert summary["last_task_to_exit_us"] >= summary["last_task_to_roles_done_us"] >= 0


@pytest.mark.gpu
def test_repeated_calls_bind_every_tensor_anew():
    """A call with the shapes of an earlier one reuses that call's binding (the fast eager
    path): every leaf and output is still the caller's tensor of this call, a tensor that
    differs in anything but its shape is bound (and rejected) in full, and a 1-row view whose
    size-1 dim has an odd stride is re-viewed as before."""
    from cutemk.errors import DTypeError, LayoutError

    torch.manual_seed(3)
    h, i = 256, 192
    g = mlp_graph(mk.sym("T", max=64), h, i, torch.bfloat16, 64, 64)
    c = g.compile("cute", scheduler="static", poison_outputs=True)
    w_gu = (torch.randn(2 * i, h, device="cuda") / h**0.5).bfloat16()
    w_down = (torch.randn(h, i, device="cuda") / i**0.5).bfloat16()
    outs = []
    for t in (8, 8, 3, 8, 3):
        x = torch.randn(t, h, device="cuda").bfloat16()
        y = c(x, w_gu, w_down)
        ref = mlp_reference(x, w_gu, w_down)
        assert y.shape == (t, h) and not torch.isnan(y).any()
        torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-2)
        outs.append(y)
    assert len({o.data_ptr() for o in outs}) == len(outs)  # a fresh output every call
    x = torch.randn(3, h, device="cuda").bfloat16()
    by_name = dict(zip([v.name for v in g.leaves], (x, w_gu, w_down)))
    torch.testing.assert_close(
        c(**by_name).float(), mlp_reference(x, w_gu, w_down), rtol=3e-2, atol=3e-2
    )
    x = torch.randn(8, h, device="cuda").bfloat16()
    with pytest.raises(DTypeError):
        c(x.float(), w_gu, w_down)
    with pytest.raises(LayoutError):
        c(torch.randn(h, 8, device="cuda").bfloat16().T, w_gu, w_down)
    with pytest.raises(LayoutError):
        c(torch.randn(8 * h + 1, device="cuda").bfloat16()[1:].view(8, h), w_gu, w_down)
    row = torch.randn(h, 1, device="cuda").bfloat16().T  # (1, h), strides (1, 1)
    c(torch.randn(1, h, device="cuda").bfloat16(), w_gu, w_down)  # binds shape (1, h)
    torch.testing.assert_close(
        c(row, w_gu, w_down).float(), mlp_reference(row, w_gu, w_down), rtol=3e-2, atol=3e-2
    )
