"""The baselines ``benchmarks/moe.py`` times cutemk against compute the MoE block: the torch
pipeline (``torch._grouped_mm``) and quack's (its varlen / gather grouped GEMMs, checked here
through quack's reference GEMMs where quack is importable) against ``moe_reference``."""

import pytest
import torch

from cutemk.layers import moe_reference


def _block(seed=0, e=8, h=64, i=32, t=9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    return x, dict(
        w_router=torch.randn(e, h, generator=g) / h**0.5,
        w_gate_up=torch.randn(e, 2 * i, h, generator=g) / h**0.5,
        w_down=torch.randn(e, h, i, generator=g) / i**0.5,
    )


def test_the_torch_pipeline_is_the_moe_block(benchmark_script):
    try:  # a torch without a CPU _grouped_mm cannot run the pipeline here
        torch._grouped_mm(
            torch.ones(2, 4), torch.ones(1, 4, 4), offs=torch.tensor([2], dtype=torch.int32)
        )
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._grouped_mm on the CPU: {e}")
    moe = benchmark_script("moe")
    for seed, t in ((0, 9), (1, 1), (2, 40)):  # experts left without tokens at small t
        x, w = _block(seed, t=t)
        y = moe.torch_moe(x, **w, top_k=2)
        ref = moe_reference(x, **w, top_k=2)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-5


def test_the_quack_pipeline_is_the_moe_block(benchmark_script, monkeypatch):
    """The benchmark's quack pipeline (``load_quack_moe``) with quack's GEMMs swapped for its
    reference GEMMs (same arguments; the GPU kernels get these): gate and up rows interleaved
    as its gated epilogue pairs them, slots gathered by token index, rows per expert as
    cu_seqlens give the block."""
    quack = pytest.importorskip("quack.gemm_interface")

    def ref_of(fn):
        def call(*args, tuned=None, **kwargs):  # the reference takes no tuning switch
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(quack, "gemm", ref_of(quack.gemm_ref))
    monkeypatch.setattr(quack, "gemm_act", ref_of(quack.gemm_act_ref))
    moe = benchmark_script("moe")
    x, w = _block(3, t=13)
    il = moe.interleave_gate_up(w["w_gate_up"])
    i = w["w_gate_up"].shape[1] // 2
    assert torch.equal(il[:, 0::2], w["w_gate_up"][:, :i])
    assert torch.equal(il[:, 1::2], w["w_gate_up"][:, i:])
    _, _, offs, _ = moe._route(x, w["w_router"], 2)
    assert offs.dtype == torch.int32 and offs[-1].item() == 13 * 2
    quack_moe = moe.load_quack_moe(False)
    y = quack_moe(x, w["w_router"], il, w["w_down"], top_k=2)
    ref = moe_reference(x, **w, top_k=2)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "moe"])
def test_the_decoder_benchmarks_torch_step_is_the_layer(sparse, benchmark_script):
    """``benchmarks/decoder_layer.py``'s torch step (bf16 and its fp32 reference) against
    ``MegaDecoderLayer`` (interpreter) built as the benchmark builds it, at small dims."""
    from cutemk.layers import DecoderConfig, MoeConfig, fold_decoder_norms
    from cutemk.nn import MegaDecoderLayer
    from cutemk.ops import rope_table

    dl = benchmark_script("decoder_layer")
    h, i, hq, hkv, d, n, page = 64, 32, 4, 2, 32, 48, 16
    dims = dl.Layer("tiny", h, i, hq, hkv, d, experts=8 if sparse else 0, top_k=2)
    g = torch.Generator().manual_seed(1)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16().float()

    w = {
        "input_norm": 1 + rnd(h, scale=0.1),
        "w_qkv": rnd((hq + 2 * hkv) * d, h, scale=h**-0.5),
        "q_norm": 1 + rnd(d, scale=0.1),
        "k_norm": 1 + rnd(d, scale=0.1),
        "cos_sin": rope_table(n + 1, d),
        "w_o": rnd(h, hq * d, scale=(hq * d) ** -0.5),
        "post_norm": 1 + rnd(h, scale=0.1),
    }
    moe = None
    if sparse:
        w["w_router"] = rnd(8, h, scale=h**-0.5)
        w["w_gate_up"] = rnd(8, 2 * i, h, scale=h**-0.5)
        w["w_down"] = rnd(8, h, i, scale=i**-0.5)
        moe = MoeConfig(h, i, 8, 2, True, block_m=64, block_n=64, router_dtype=None)
    else:
        w["w_gate_up"] = rnd(2 * i, h, scale=h**-0.5)
        w["w_down"] = rnd(h, i, scale=i**-0.5)
    cfg = DecoderConfig(
        hidden=h,
        intermediate=i,
        heads=hq,
        kv_heads=hkv,
        head_dim=d,
        page_size=page,
        max_pages=(n + page) // page + 1,
        max_positions=n + 1,
        block_m=64,
        block_n=64,
        fold_norms=True,
    )
    wm = fold_decoder_norms(dict(w), moe=sparse)
    layer = MegaDecoderLayer(wm, cfg, moe=moe, max_batch=4, backend="interpret")
    b, pages = 3, n // page
    x = torch.randn(b, h, generator=g)
    pos = torch.full((b,), n - 1, dtype=torch.int32)
    kc, vc = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    k_pages = kc.permute(0, 2, 1, 3).reshape(b * pages, page, hkv, d).contiguous()
    v_pages = vc.permute(0, 2, 1, 3).reshape(b * pages, page, hkv, d).contiguous()
    table = torch.zeros(b, cfg.max_pages, dtype=torch.int32)
    table[:, :pages] = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    y = layer(x, pos, k_pages, v_pages, table, pos + 1)
    ref = dl.torch_step(x, pos, kc.clone(), vc.clone(), w, n, dims, fp32=True)
    assert ((y - ref).norm() / ref.norm()).item() < 2e-3
    if sparse:
        assert dl._touched_experts(x, pos, kc, vc, w, n, dims) <= 8
    bf16 = {k: v.bfloat16() for k, v in w.items()}
    got = dl.torch_step(x.bfloat16(), pos, kc.bfloat16(), vc.bfloat16(), bf16, n, dims)
    assert ((got.float() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.parametrize("layer", ["decoder", "mlp", "moe"])
def test_schedule_view_prints_every_sm_queue(layer, benchmark_script, capsys):
    """``benchmarks/schedule_view.py``: the layer's static schedule at one token, checked, its
    queues grouped by node sequence; the groups count every SM."""
    view = benchmark_script("schedule_view")
    assert view.main([layer, "--batch", "1", "--sms", "132", "--ties", "idle"]) == 0
    lines = capsys.readouterr().out.splitlines()
    groups = [line for line in lines if " SMs: " in line]
    assert groups and sum(int(line.split()[0]) for line in groups) == 132
