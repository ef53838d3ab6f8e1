"""The baselines ``benchmarks/moe.py`` times cutemk against compute the MoE block: the torch
pipeline (``torch._grouped_mm``) and quack's (its varlen / gather grouped GEMMs, checked here
through quack's reference GEMMs where quack is importable) against ``moe_reference``."""

import importlib.util
from pathlib import Path

import pytest
import torch

from cutemk.layers import moe_reference

_PATH = Path(__file__).parent.parent / "benchmarks" / "moe.py"


def _moe_bench():
    spec = importlib.util.spec_from_file_location("moe_bench", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _block(seed=0, e=8, h=64, i=32, t=9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    return x, dict(
        w_router=torch.randn(e, h, generator=g) / h**0.5,
        w_gate_up=torch.randn(e, 2 * i, h, generator=g) / h**0.5,
        w_down=torch.randn(e, h, i, generator=g) / i**0.5,
    )


def test_the_torch_pipeline_is_the_moe_block():
    try:  # a torch without a CPU _grouped_mm cannot run the pipeline here
        torch._grouped_mm(
            torch.ones(2, 4), torch.ones(1, 4, 4), offs=torch.tensor([2], dtype=torch.int32)
        )
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm on the CPU: {e}")
    moe = _moe_bench()
    for seed, t in ((0, 9), (1, 1), (2, 40)):  # experts left without tokens at small t
        x, w = _block(seed, t=t)
        y = moe.torch_moe(x, **w, top_k=2)
        ref = moe_reference(x, **w, top_k=2)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-5


def test_the_quack_pipeline_layout_is_the_moe_block():
    """Gate and up rows interleaved as quack's gated epilogue pairs them, slots gathered by
    token index, rows per expert as cu_seqlens: quack's reference GEMMs on these operands
    give the block (its GPU kernels are timed against the same operands)."""
    quack = pytest.importorskip("quack.gemm_interface")
    moe = _moe_bench()
    x, w = _block(3, t=13)
    il = moe.interleave_gate_up(w["w_gate_up"])
    i = w["w_gate_up"].shape[1] // 2
    assert torch.equal(il[:, 0::2], w["w_gate_up"][:, :i])
    assert torch.equal(il[:, 1::2], w["w_gate_up"][:, i:])
    wts, order, offs, tok = moe._route(x, w["w_router"], 2)
    assert offs.dtype == torch.int32 and offs[-1].item() == 13 * 2
    _, a = quack.gemm_act_ref(
        x,
        il.transpose(1, 2),
        activation="swiglu",
        cu_seqlens_m=offs,
        A_idx=tok.to(torch.int32),
        store_preact=False,
    )
    d = quack.gemm_ref(a, w["w_down"].transpose(1, 2), cu_seqlens_m=offs)
    y = moe._combine(x.shape[0], tok, d, wts, order, x)
    ref = moe_reference(x, **w, top_k=2)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5
