"""The warp-specialized worker's pipelines on the GPU: many tasks per SM (the ring and the task
queue carry their state across tasks), several ring ops in one kernel (slots viewed with each
op's layouts), and a producer that runs ahead of its consumers. Every case runs under the
watchdog, whose bounded pipeline waits turn a protocol bug into an error naming the wait."""

import pytest
import torch

import cutemk as mk
from cutemk import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _check(y, ref, what):
    assert not torch.isnan(y).any(), f"{what}: unwritten output"
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("num_sms", [1, 3])
@pytest.mark.parametrize("epilogue", [None, "silu_mul"])
def test_one_gemm_many_tiles_per_sm(scheduler, num_sms, epilogue):
    torch.manual_seed(num_sms)
    g = mk.Graph("gemm")
    k, n = 512, 384
    x = g.input("x", (mk.sym("T", 512), k), torch.bfloat16)
    w = g.weight("w", (2 * n if epilogue else n, k), torch.bfloat16)
    g.output(g.call(ops.gemm, x, w, block_m=64, block_n=64, epilogue=epilogue), "y")
    c = g.compile(
        "cute",
        scheduler=scheduler,
        num_sms=num_sms,
        watchdog=True,
        timeout_s=5.0,
        poison_outputs=True,
    )
    for t in (1, 200, 512):
        a = torch.randn(t, k, device="cuda").bfloat16()
        b = (torch.randn(2 * n if epilogue else n, k, device="cuda") / k**0.5).bfloat16()
        ref = a.float() @ b.float().T
        if epilogue:
            ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
        _check(c(a, b), ref, f"T={t}")


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_two_chained_gemms_of_different_shapes(scheduler):
    """y = (x W1^T) W2^T with 128x128 then 64x256 tiles: one ring, two views of its slots; the
    second GEMM's weights load before its events, its activations after."""
    torch.manual_seed(3)
    g = mk.Graph("chain")
    x = g.input("x", (mk.sym("T", 1024), 256), torch.bfloat16)
    w1 = g.weight("w1", (512, 256), torch.bfloat16)
    w2 = g.weight("w2", (256, 512), torch.bfloat16)
    h = g.call(ops.gemm, x, w1, block_m=128, block_n=128)
    g.output(g.call(ops.gemm, h, w2, block_m=64, block_n=256), "y")
    c = g.compile("cute", scheduler=scheduler, num_sms=8, watchdog=True, timeout_s=5.0)
    a = torch.randn(1000, 256, device="cuda").bfloat16()
    b1 = (torch.randn(512, 256, device="cuda") / 16).bfloat16()
    b2 = (torch.randn(256, 512, device="cuda") / 22).bfloat16()
    ref = (a.float() @ b1.float().T).bfloat16().float() @ b2.float().T
    _check(c(a, b1, b2), ref, "chain")


@pytest.mark.parametrize("block,epilogue", [((64, 32), "silu_mul"), ((64, 128), None)])
def test_gemm_with_few_rows_loads_short_a_boxes(block, epilogue):
    """A graph of at most 12 rows loads 16-row A boxes into 64-row slots (the rest of each slot
    holds stale data that only reaches output rows the TMA store never writes)."""
    torch.manual_seed(5)
    g = mk.Graph("few_rows")
    k, n = 1024, 256
    x = g.input("x", (mk.sym("T", 12), k), torch.bfloat16)
    w = g.weight("w", (2 * n if epilogue else n, k), torch.bfloat16)
    g.output(g.call(ops.gemm, x, w, block_m=block[0], block_n=block[1], epilogue=epilogue), "y")
    assert g.nodes[0].op.sm90().a_rows == 16
    c = g.compile("cute", scheduler="static", watchdog=True, timeout_s=5.0, poison_outputs=True)
    b = (torch.randn(2 * n if epilogue else n, k, device="cuda") / k**0.5).bfloat16()
    for t in (1, 5, 12):
        a = torch.randn(t, k, device="cuda").bfloat16()
        ref = a.float() @ b.float().T
        if epilogue:
            ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
        _check(c(a, b), ref, f"T={t}")
