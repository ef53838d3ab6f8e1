"""Decoder-layer test cases shared by the decoder tests: small configs, transformers' Qwen3 layers
with random weights, and a step's inputs (a paged cache holding what HF's own projections,
norms and rotary give the earlier tokens) with HF's output as the reference."""

import torch

from cutemk import ops
from cutemk.layers import DecoderConfig, fold_norm

CFG = DecoderConfig(
    hidden=64,
    intermediate=96,
    heads=4,
    kv_heads=2,
    head_dim=32,
    page_size=8,
    max_pages=16,
    max_positions=256,
    block_m=16,
    block_n=32,
    attention_align=16,
)


def _hf_attention(cfg: DecoderConfig) -> dict:
    """transformers' config fields of a decoder layer's sizes, norms and rotary settings."""
    return {
        "hidden_size": cfg.hidden,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.eps,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": cfg.max_positions,
    }


def hf_layer(cfg: DecoderConfig):
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    hf_cfg = Qwen3Config(intermediate_size=cfg.intermediate, **_hf_attention(cfg))
    return randomized(Qwen3DecoderLayer, hf_cfg, 0), Qwen3RotaryEmbedding(hf_cfg)


def randomized(layer_cls, hf_cfg, seed: int):
    """An HF layer (SDPA attention) with random weights: norms near 1, others ~1/sqrt(fan-in)."""
    hf_cfg._attn_implementation = "sdpa"
    layer = layer_cls(hf_cfg, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return layer


def attn_weights(layer, cfg):
    a = layer.self_attn
    return {
        "input_norm": layer.input_layernorm.weight.detach(),
        "w_qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
        "q_norm": a.q_norm.weight.detach(),
        "k_norm": a.k_norm.weight.detach(),
        "cos_sin": ops.rope_table(cfg.max_positions, cfg.head_dim),
        "w_o": a.o_proj.weight.detach(),
        "post_norm": layer.post_attention_layernorm.weight.detach(),
    }


def layer_weights(layer, cfg):
    m = layer.mlp
    return {
        **attn_weights(layer, cfg),
        "w_gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
        "w_down": m.down_proj.weight.detach(),
    }


def step_case(layer, rotary, cfg, lens, gen):
    """Graph inputs for one decode step over sequences of ``lens`` tokens (the last one new),
    and HF's output for each sequence's last token."""
    inputs, want = case_inputs(layer, rotary, cfg, [(n, 1) for n in lens], gen)
    del inputs["cu_seqlens"]
    return inputs, want


def case_inputs(layer, rotary, cfg, seqs, gen):
    """Graph inputs for one step over sequences of ``(length, new)`` tokens (the last ``new``
    of each new, side by side in x), and HF's output for the new tokens."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    a, hkv, d, page = layer.self_attn, cfg.kv_heads, cfg.head_dim, cfg.page_size
    pages = [-(-n // page) for n, _ in seqs]
    total = sum(pages) + 1
    perm = torch.randperm(total, generator=gen).tolist()
    k_cache = torch.randn(total, page, hkv, d, generator=gen)  # garbage outside the sequences
    v_cache = torch.randn(total, page, hkv, d, generator=gen)
    table = torch.zeros(len(seqs), cfg.max_pages, dtype=torch.int32)
    xs, want, positions, i = [], [], [], 0
    with torch.no_grad():
        for b, (n, new) in enumerate(seqs):
            table[b, : pages[b]] = torch.tensor(perm[i : i + pages[b]], dtype=torch.int32)
            i += pages[b]
            x = torch.randn(1, n, cfg.hidden, generator=gen)
            pos = torch.arange(n)[None]
            cos, sin = rotary(x, pos)
            want.append(layer(x, position_ids=pos, position_embeddings=(cos, sin))[0, n - new :])
            xs.append(x[0, n - new :])
            positions += list(range(n - new, n))
            old = n - new
            if old:  # the earlier tokens' keys and values, as HF's attention makes them
                hn = layer.input_layernorm(x[:, :old])
                k = a.k_norm(a.k_proj(hn).view(1, old, hkv, d)).transpose(1, 2)
                v = a.v_proj(hn).view(1, old, hkv, d)
                _, k = apply_rotary_pos_emb(k, k, cos[:, :old], sin[:, :old])
                k = k.transpose(1, 2)[0]
                for p_ in range(old):
                    pg, slot = int(table[b, p_ // page]), p_ % page
                    k_cache[pg, slot], v_cache[pg, slot] = k[p_], v[0, p_]
    cu = [0]
    for _, new in seqs:
        cu.append(cu[-1] + new)
    inputs = {
        "x": torch.cat(xs),
        "positions": torch.tensor(positions, dtype=torch.int32),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "page_table": table,
        "seq_lens": torch.tensor([n for n, _ in seqs], dtype=torch.int32),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
    }
    return inputs, torch.cat(want)


def folded(w):
    """The weights with the RMSNorm weights folded into the projections (``fold_norms``)."""
    w = dict(w)
    w["w_qkv"] = fold_norm(w["w_qkv"], w.pop("input_norm"))
    w["w_gate_up"] = fold_norm(w["w_gate_up"], w.pop("post_norm"))
    return w


# a small layer for the GPU tests: 512 wide, 8 / 2 heads of 128, 16-token pages
GPU_CFG = DecoderConfig(
    hidden=512,
    intermediate=1024,
    heads=8,
    kv_heads=2,
    head_dim=128,
    page_size=16,
    max_pages=64,
    max_positions=2048,
)


def hf_moe_layer(cfg: DecoderConfig, experts: int, top_k: int, inter: int):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeRotaryEmbedding,
    )

    hf_cfg = Qwen3MoeConfig(
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **_hf_attention(cfg),
    )
    return randomized(Qwen3MoeDecoderLayer, hf_cfg, 4), Qwen3MoeRotaryEmbedding(hf_cfg)


QWEN3_8B_DECODE = DecoderConfig(
    hidden=4096,
    intermediate=12288,
    heads=32,
    kv_heads=8,
    head_dim=128,
    max_pages=512,
    block_m=64,
    block_n=64,
    fold_norms=True,
)
"""Qwen3-8B's decode layer as the compile checks build it (64 x 64 GEMM tiles, norms folded)."""


# Qwen3-30B-A3B's attention and hidden sizes (its sparse block given as a MoeConfig)
QWEN3_30B_DECODE = DecoderConfig(
    hidden=2048,
    intermediate=768,
    heads=32,
    kv_heads=4,
    head_dim=128,
    max_pages=512,
    block_m=64,
    block_n=64,
)


def bare_decoder(cfg: DecoderConfig, moe=None, max_batch: int = 64):
    """A ``MegaDecoderLayer`` without weights (its graphs need none), decode steps only, its
    SM count left to the default."""
    from cutemk.nn import MegaDecoderLayer
    from cutemk.regimes import DECODER_MOE_REGIME_LIMITS

    mega = MegaDecoderLayer.__new__(MegaDecoderLayer)
    torch.nn.Module.__init__(mega)
    mega.cfg, mega.moe, mega.max_batch, mega.max_prefill_tokens = cfg, moe, max_batch, 0
    mega.prefill_tiles, mega.num_sms = None, None
    if moe is not None:
        mega.regime_limits = DECODER_MOE_REGIME_LIMITS
    return mega
