"""``ops.qk_norm_rope`` against Hugging Face's Qwen3 pieces (``Qwen3RMSNorm`` on each head,
``Qwen3RotaryEmbedding`` + ``apply_rotary_pos_emb``) on random positions: interpreter on the
CPU in fp32, a compile of the kernel for sm_90a, and (``gpu``) the megakernel in bf16. A
position outside the rotary table makes that token's q and k NaN."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.runtime import compile_offline

HQ, HKV, D, MAXPOS = 8, 2, 64, 512


def _graph(dtype, hq=HQ, hkv=HKV, d=D, maxpos=MAXPOS, head_block=4):
    g = mk.Graph("qk_norm_rope")
    T = mk.sym("T", min=1, max=256)
    qkv = g.input("qkv", (T, (hq + 2 * hkv) * d), dtype)
    qw = g.weight("q_weight", (d,), dtype)
    kw = g.weight("k_weight", (d,), dtype)
    cs = g.weight("cos_sin", (maxpos, d), torch.float32)
    pos = g.input("positions", (T,), torch.int32)
    q, k, v = g.call(
        ops.qk_norm_rope, qkv, qw, kw, cs, pos, heads=hq, kv_heads=hkv, head_block=head_block
    )
    for name, val in (("q", q), ("k", k), ("v", v)):
        g.output(val, name)
    return g


def _hf(qkv, qw, kw, positions, hq=HQ, hkv=HKV, d=D, eps=1e-6, theta=1_000_000.0):
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = Qwen3Config(
        hidden_size=hq * d,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=d,
        rope_theta=theta,
        max_position_embeddings=MAXPOS,
    )
    t = qkv.shape[0]
    x = qkv.float().view(t, hq + 2 * hkv, d)
    qn, kn = Qwen3RMSNorm(d, eps), Qwen3RMSNorm(d, eps)
    with torch.no_grad():
        qn.weight.copy_(qw.float())
        kn.weight.copy_(kw.float())
        q = qn(x[:, :hq]).transpose(0, 1)[None]  # (1, Hq, T, D)
        k = kn(x[:, hq : hq + hkv]).transpose(0, 1)[None]
        cos, sin = Qwen3RotaryEmbedding(cfg)(x, positions.long()[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1), x[:, hq + hkv :]


def _inputs(t, gen, dtype=torch.float32, device="cpu"):
    return {
        "qkv": torch.randn(t, (HQ + 2 * HKV) * D, generator=gen).to(dtype).to(device),
        "q_weight": (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).to(device),
        "k_weight": (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype).to(device),
        "cos_sin": ops.rope_table(MAXPOS, D).to(device),
        "positions": torch.randint(0, MAXPOS, (t,), generator=gen, dtype=torch.int32).to(device),
    }


# head blocks of 5 of the 12 heads: tiles across the q/k and k/v boundaries, a short last one
@pytest.mark.parametrize("head_block", [4, 5])
def test_matches_hf_interpreted(head_block):
    pytest.importorskip("transformers")
    c = _graph(torch.float32, head_block=head_block).compile("interpret", num_sms=4)
    gen = torch.Generator().manual_seed(0)
    for t in (1, 5, 37):
        a = _inputs(t, gen)
        q, k, v = c(**a)
        hq, hk, hv = _hf(a["qkv"], a["q_weight"], a["k_weight"], a["positions"])
        torch.testing.assert_close(q, hq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, hk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, hv)


def test_position_outside_the_table_is_nan():
    c = _graph(torch.float32).compile("interpret", num_sms=2)
    a = _inputs(6, torch.Generator().manual_seed(1))
    a["positions"][2] = MAXPOS
    q, k, v = c(**a)
    assert torch.isnan(q[2]).all() and torch.isnan(k[2]).all()
    assert not torch.isnan(q[[0, 1, 3, 4, 5]]).any() and not torch.isnan(v).any()


def test_compiles_for_hopper(tmp_path):
    g = _graph(torch.bfloat16, hq=32, hkv=8, d=128, maxpos=40960)
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert "shfl.sync.bfly" in ptx_file.read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("head_block", [4, 5])
def test_matches_hf_on_the_gpu(head_block):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("transformers")
    c = _graph(torch.bfloat16, head_block=head_block).compile("cute", poison_outputs=True)
    gen = torch.Generator().manual_seed(2)
    for t in (1, 7, 200):
        a = _inputs(t, gen, torch.bfloat16, "cuda")
        q, k, v = c(**a)
        hq, hk, hv = _hf(
            a["qkv"].cpu(), a["q_weight"].cpu(), a["k_weight"].cpu(), a["positions"].cpu()
        )
        torch.testing.assert_close(q.float().cpu(), hq, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(k.float().cpu(), hk, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v.float().cpu(), hv.float(), rtol=1e-2, atol=1e-2)
