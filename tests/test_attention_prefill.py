"""Causal prefill attention over a paged KV cache with variable lengths
(``ops.attention_prefill``), against an fp32 softmax per sequence: new tokens after a cached
prefix or none, GQA ratios, scattered pages; bad lengths make exactly that sequence NaN. CPU:
the interpreter (race checker on) and a compile of the kernel for sm_90a. GPU (``gpu``): the
megakernel, both schedulers, NaN-poisoned outputs, bit-identical reruns."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import re

import pytest
import torch

import cutemk as mk
from cutemk import ops
from cutemk.runtime import compile_offline


def _graph(hq, hkv, d, page, max_pages, dtype, max_b=8, max_t=8192, step=None):
    g = mk.Graph("prefill_attention")
    B = mk.sym("B", min=1, max=max_b)
    T = mk.sym("T", min=1, max=max_t)
    q = g.input("q", (T, hq, d), dtype)
    k = g.input("k_cache", (mk.sym("P", min=1, max=1 << 16), page, hkv, d), dtype)
    v = g.input("v_cache", (k.spec.shape[0], page, hkv, d), dtype)
    pt = g.input("page_table", (B, max_pages), torch.int32)
    lens = g.input("seq_lens", (B,), torch.int32)
    cu = g.input("cu_seqlens", (B + 1,), torch.int32)
    out = g.call(ops.attention_prefill, q, k, v, pt, lens, cu, step=step)
    g.output(out, "out")
    return g


def _inputs(seqs, hq, hkv, d, page, max_pages, dtype, gen, device="cpu", nan_tail=True):
    """``seqs``: (length after this step, new tokens) per sequence. With ``nan_tail`` the
    slots of a sequence's last page past its length hold NaN (they are not the sequence's:
    nothing may read them into a result)."""
    pages_needed = [-(-n // page) for n, _ in seqs]
    total = sum(pages_needed) + 3
    perm = torch.randperm(total, generator=gen).tolist()  # pages scattered over the cache
    table = torch.zeros(len(seqs), max_pages, dtype=torch.int32)
    i = 0
    for r, n in enumerate(pages_needed):
        table[r, :n] = torch.tensor(perm[i : i + n], dtype=torch.int32)
        i += n
    cu = [0]
    for _, new in seqs:
        cu.append(cu[-1] + new)
    args = {
        "q": torch.randn(cu[-1], hq, d, generator=gen).to(dtype),
        "k_cache": torch.randn(total, page, hkv, d, generator=gen).to(dtype),
        "v_cache": torch.randn(total, page, hkv, d, generator=gen).to(dtype),
        "page_table": table,
        "seq_lens": torch.tensor([n for n, _ in seqs], dtype=torch.int32),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
    }
    if nan_tail:
        for r, (n, _) in enumerate(seqs):
            if n % page:
                last = int(table[r, n // page])
                args["k_cache"][last, n % page :] = float("nan")
                args["v_cache"][last, n % page :] = float("nan")
    return {k: v.to(device) for k, v in args.items()}


def prefill_reference(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens):
    """fp32, per sequence: its keys gathered from its pages, each new token attending to the
    positions up to its own."""
    t, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(t, hq, d)
    for b in range(len(seq_lens)):
        lo, hi, n = int(cu_seqlens[b]), int(cu_seqlens[b + 1]), int(seq_lens[b])
        pos = torch.arange(n)
        pages = page_table[b, pos // page].long().cpu()
        k = k_cache.cpu()[pages, pos % page].float().repeat_interleave(hq // hkv, dim=1)
        v = v_cache.cpu()[pages, pos % page].float().repeat_interleave(hq // hkv, dim=1)
        qb = q.cpu()[lo:hi].float()  # (new, Hq, D)
        at = n - (hi - lo) + torch.arange(hi - lo)
        s = torch.einsum("rhd,khd->hrk", qb, k) / d**0.5
        s = s.masked_fill(pos[None, None, :] > at[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hrk,khd->rhd", torch.softmax(s, dim=-1), v)
    return out.reshape(t, hq * d)


CASES = [
    [(1, 1)],
    [(7, 7), (129, 129)],
    [(300, 45), (33, 1), (70, 70)],  # a cached prefix, one new token, a whole sequence
]


@pytest.mark.parametrize("hq,hkv,page", [(4, 1, 16), (8, 2, 64), (8, 8, 16), (16, 2, 8)])
def test_prefill_attention_interpreted(hq, hkv, page):
    d, max_pages = 64, 40
    c = _graph(hq, hkv, d, page, max_pages, torch.float32).compile("interpret", num_sms=8)
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    for seqs in CASES:
        a = _inputs(seqs, hq, hkv, d, page, max_pages, torch.float32, gen)
        torch.testing.assert_close(c(**a), prefill_reference(**a), rtol=1e-4, atol=1e-4)


def test_prefill_attention_bad_lengths_make_that_sequence_nan():
    hq, hkv, d, page, max_pages = 8, 2, 64, 16, 40
    c = _graph(hq, hkv, d, page, max_pages, torch.float32).compile("interpret", num_sms=4)
    gen = torch.Generator().manual_seed(5)
    a = _inputs([(50, 20), (40, 10), (30, 30)], hq, hkv, d, page, max_pages, torch.float32, gen)
    a["seq_lens"][1] = 5  # shorter than its 10 new tokens
    out = c(**a)
    assert torch.isnan(out[20:30]).all()
    ref = prefill_reference(**{**a, "seq_lens": torch.tensor([50, 40, 30], dtype=torch.int32)})
    keep = torch.cat([torch.arange(20), torch.arange(30, 60)])
    torch.testing.assert_close(out[keep], ref[keep], rtol=1e-4, atol=1e-4)


def test_a_bad_sequence_cannot_take_the_others_tiles():
    """Offsets far outside q: that sequence's blocks cover only its rows within q (NaN), so
    the grid still reaches the next sequence, which is exact."""
    hq, hkv, d, page, max_pages = 8, 1, 64, 16, 40
    c = _graph(hq, hkv, d, page, max_pages, torch.float32).compile("interpret", num_sms=4)
    gen = torch.Generator().manual_seed(6)
    a = _inputs([(60, 60), (4, 4)], hq, hkv, d, page, max_pages, torch.float32, gen)
    a["cu_seqlens"] = torch.tensor([-300, 60, 64], dtype=torch.int32)
    out = c(**a)
    assert torch.isnan(out[:60]).all()
    ref = prefill_reference(**{**a, "cu_seqlens": torch.tensor([0, 60, 64], dtype=torch.int32)})
    torch.testing.assert_close(out[60:], ref[60:], rtol=1e-4, atol=1e-4)


def test_prefill_attention_compiles_for_hopper(tmp_path, spill_stores, wgmma_serialized):
    g = _graph(32, 8, 128, 16, 1024, torch.bfloat16, max_b=64)
    compile_offline(g, "dynamic", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert spill_stores(ptx_file) == 0
    assert not wgmma_serialized(ptx_file)
    ptx = ptx_file.read_text()
    assert "cp.async.bulk.tensor" in ptx
    # S = q K^T from shared memory; o += P V with P from registers (A as 4 registers)
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in ptx
    assert re.search(r"m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, \{[^}]*\}, %rd", ptx)
    assert "mma.sync" not in ptx
    assert ".local" not in ptx
    # the two warpgroups' turns on the tensor cores (one syncs, the other arrives) and the
    # consumers' barrier are named barriers of different code: unaligned (device.config.
    # named_sync / named_arrive), never ``bar.sync`` / ``bar.arrive`` with a thread count
    assert re.search(r"\bbarrier(\.cta)?\.arrive\s+%r\d+, 256;", ptx)
    assert re.search(r"\bbarrier\.sync\s+%r\d+, 256;", ptx)
    assert not re.search(r"\bbar(\.cta)?\.(sync|arrive)\s+(%r\d+|\d+),", ptx)


def test_profiled_prefill_tile_stamps_its_phases_without_spills(
    tmp_path, spill_stores, wgmma_serialized
):
    """``profile="slices"``: the tile reads the SM clock around each step's phases (the loop
    top, its turn, S, the softmax, the previous P V; ``profiling.PHASE_FIELDS``) and its first
    thread stores them with the slice's stamps, at no spill and with the wgmma pipelined; the
    production kernel reads no clock."""
    g = _graph(32, 8, 128, 16, 1024, torch.bfloat16, max_b=64)
    compile_offline(g, "static", profile="slices", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert spill_stores(ptx_file) == 0
    assert not wgmma_serialized(ptx_file)
    assert ptx_file.read_text().count("%clock64") >= 6
    plain = tmp_path / "plain"
    plain.mkdir()
    compile_offline(g, "static", options=f"--keep-ptx --dump-dir={plain}")
    (ptx_plain,) = plain.glob("*.ptx")
    assert "%clock64" not in ptx_plain.read_text()


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("d,page", [(128, 16), (64, 8), (128, 256)])
def test_wide_step_tile_compiles_for_hopper(
    tmp_path, spill_stores, wgmma_serialized, scheduler, d, page
):
    """``step=128``: a step's K and V in a ring slot each, S one m64 n128 wgmma per k16 (no
    m64 n64), no spill, the wgmma pipelined; the loads are one TMA box per page (of at most
    64 rows) and 64 dimensions, K or V alone."""
    g = _graph(32, 8, d, page, 1024, torch.bfloat16, max_b=64, step=128)
    op = g.nodes[0].op
    assert op.step == 128 and op.sm90().slices == 2 * (1024 * page // 128)
    assert op.sm90().tx_bytes == 128 * d * 2 and op.sm90().v_offset == 0
    compile_offline(g, scheduler, options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert spill_stores(ptx_file) == 0
    assert not wgmma_serialized(ptx_file)
    ptx = ptx_file.read_text()
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx
    if d == 128:  # (at D = 64, P V is m64 n64)
        assert "m64n64k16" not in ptx


def test_prefill_step_is_64_or_128_and_read_from_the_environment(monkeypatch):
    g = _graph(32, 8, 128, 16, 64, torch.bfloat16)
    assert g.nodes[0].op.step == 64
    monkeypatch.setenv("CUTEMK_PREFILL_STEP", "128")
    assert _graph(32, 8, 128, 16, 64, torch.bfloat16).nodes[0].op.step == 128
    monkeypatch.setenv("CUTEMK_PREFILL_STEP", "96")
    with pytest.raises(ValueError, match="CUTEMK_PREFILL_STEP"):
        _graph(32, 8, 128, 16, 64, torch.bfloat16)
    monkeypatch.delenv("CUTEMK_PREFILL_STEP")
    with pytest.raises(ValueError, match="step must be 64 or 128"):
        _graph(32, 8, 128, 16, 64, torch.bfloat16, step=96)


@pytest.mark.gpu
@pytest.mark.parametrize("step", [64, 128])
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
@pytest.mark.parametrize("hq,hkv,page", [(32, 8, 16), (16, 2, 64), (8, 8, 16), (16, 8, 32)])
def test_prefill_attention_on_the_gpu(scheduler, hq, hkv, page, step):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    d, max_pages = 128, 1024
    c = _graph(hq, hkv, d, page, max_pages, torch.bfloat16, max_b=64, step=step).compile(
        "cute", scheduler=scheduler, watchdog=True, poison_outputs=True
    )
    gen = torch.Generator().manual_seed(1)
    for seqs in CASES + [[(4097, 4097)], [(2000, 700), (9, 9), (1500, 1)]]:
        a = _inputs(seqs, hq, hkv, d, page, max_pages, torch.bfloat16, gen, "cuda")
        out = c(**a)
        ref = prefill_reference(**a)
        err = ((out.float().cpu() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (seqs, err)
        torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)  # every row
        assert torch.equal(c(**a), out)


def _append_graph(hq, hkv, d, page, max_pages, dtype, max_b=8, max_t=8192):
    """The prefill step's attention part: the new keys and values appended to the cache,
    then attention over it (``kv_append_varlen``, ``attention_prefill``)."""
    g = mk.Graph("prefill_append_attention")
    B = mk.sym("B", min=1, max=max_b)
    T = mk.sym("T", min=1, max=max_t)
    q = g.input("q", (T, hq, d), dtype)
    k_new = g.input("k_new", (T, hkv, d), dtype)
    v_new = g.input("v_new", (T, hkv, d), dtype)
    k = g.input("k_cache", (mk.sym("P", min=1, max=1 << 16), page, hkv, d), dtype)
    v = g.input("v_cache", (k.spec.shape[0], page, hkv, d), dtype)
    pt = g.input("page_table", (B, max_pages), torch.int32)
    lens = g.input("seq_lens", (B,), torch.int32)
    cu = g.input("cu_seqlens", (B + 1,), torch.int32)
    k2, v2 = g.call(ops.kv_append_varlen, k_new, v_new, k, v, pt, lens, cu)
    g.output(g.call(ops.attention_prefill, q, k2, v2, pt, lens, cu), "out")
    return g


def _split_new(a, hkv):
    """Take the new tokens' keys and values out of the cache (their slots poisoned), as the
    step's inputs: the append must put them back."""
    page = a["k_cache"].shape[1]
    cu, lens, table = a["cu_seqlens"], a["seq_lens"], a["page_table"]
    t = a["q"].shape[0]
    k_new = torch.empty(t, hkv, a["k_cache"].shape[3], dtype=a["k_cache"].dtype)
    v_new = torch.empty_like(k_new)
    k_cache, v_cache = a["k_cache"].clone(), a["v_cache"].clone()
    for b in range(len(lens)):
        lo, hi, n = int(cu[b]), int(cu[b + 1]), int(lens[b])
        for i in range(lo, hi):
            pos = n - (hi - lo) + (i - lo)
            pg, slot = int(table[b, pos // page]), pos % page
            k_new[i], v_new[i] = k_cache[pg, slot], v_cache[pg, slot]
            k_cache[pg, slot] = float("nan")
            v_cache[pg, slot] = float("nan")
    return {**a, "k_new": k_new, "v_new": v_new, "k_cache": k_cache, "v_cache": v_cache}


@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_append_then_attend_interpreted(scheduler):
    """The new tokens' keys and values reach the cache before any tile attends to them: the
    result is the attention over the full cache (the append's slots were NaN before)."""
    hq, hkv, d, page, max_pages = 8, 2, 64, 16, 40
    g = _append_graph(hq, hkv, d, page, max_pages, torch.float32)
    c = g.compile("interpret", num_sms=6, scheduler=scheduler)
    gen = torch.Generator().manual_seed(7)
    for seqs in CASES:
        full = _inputs(seqs, hq, hkv, d, page, max_pages, torch.float32, gen)
        a = _split_new(full, hkv)
        out = c(**a)
        torch.testing.assert_close(out, prefill_reference(**full), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a["k_cache"], full["k_cache"], equal_nan=True)


def test_append_then_attend_compiles_for_hopper(tmp_path, spill_stores):
    g = _append_graph(32, 8, 128, 16, 1024, torch.bfloat16, max_b=64)
    compile_offline(g, "dynamic", options=f"--keep-ptx --dump-dir={tmp_path}")
    (ptx_file,) = tmp_path.glob("*.ptx")
    assert spill_stores(ptx_file) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_append_then_attend_on_the_gpu(scheduler):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    hq, hkv, d, page, max_pages = 32, 8, 128, 16, 1024
    c = _append_graph(hq, hkv, d, page, max_pages, torch.bfloat16, max_b=64).compile(
        "cute", scheduler=scheduler, watchdog=True, poison_outputs=True
    )
    gen = torch.Generator().manual_seed(2)
    for seqs in CASES + [[(2000, 700), (9, 9), (1500, 1)]]:
        full = _inputs(seqs, hq, hkv, d, page, max_pages, torch.bfloat16, gen)
        a = {k: v.cuda() for k, v in _split_new(full, hkv).items()}
        out = c(**a)
        ref = prefill_reference(**full)
        torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(a["k_cache"].cpu(), full["k_cache"], equal_nan=True)
        torch.testing.assert_close(a["v_cache"].cpu(), full["v_cache"], equal_nan=True)


def test_append_skips_bad_data():
    """``kv_append_varlen`` writes nothing for a sequence of inconsistent lengths, a position
    past the page table or a page outside the cache; the other rows land."""
    hkv, d, page, max_pages = 2, 64, 16, 4
    g = mk.Graph("append")
    B, T = mk.sym("B", min=1, max=8), mk.sym("T", min=1, max=256)
    kn = g.input("k_new", (T, hkv, d), torch.float32)
    vn = g.input("v_new", (T, hkv, d), torch.float32)
    kc = g.input("k_cache", (mk.sym("P", min=1, max=64), page, hkv, d), torch.float32)
    vc = g.input("v_cache", (kc.spec.shape[0], page, hkv, d), torch.float32)
    pt = g.input("page_table", (B, max_pages), torch.int32)
    lens = g.input("seq_lens", (B,), torch.int32)
    cu = g.input("cu_seqlens", (B + 1,), torch.int32)
    k2, v2 = g.call(ops.kv_append_varlen, kn, vn, kc, vc, pt, lens, cu)
    g.output(k2, "k_out")
    g.output(v2, "v_out")
    c = g.compile("interpret", num_sms=4)
    gen = torch.Generator().manual_seed(8)
    t = 12
    a = {
        "k_new": torch.randn(t, hkv, d, generator=gen),
        "v_new": torch.randn(t, hkv, d, generator=gen),
        "k_cache": torch.zeros(8, page, hkv, d),
        "v_cache": torch.zeros(8, page, hkv, d),
        # sequence 0: fine (page 1, then a page id outside the cache); 1: shorter than its new
        # tokens; 2: past the page table
        "page_table": torch.tensor([[1, 99, 0, 0], [2, 3, 0, 0], [4, 5, 6, 7]], dtype=torch.int32),
        "seq_lens": torch.tensor([20, 2, 70], dtype=torch.int32),
        "cu_seqlens": torch.tensor([0, 6, 9, 12], dtype=torch.int32),
    }
    c(**a)
    kcache = a["k_cache"]
    # sequence 0's rows 0..5 go to positions 14..19: 14, 15 in page 1, 16..19 in page 99
    torch.testing.assert_close(kcache[1, 14:16], a["k_new"][0:2])
    assert not kcache[2:4].any()  # sequence 1 wrote nothing
    assert not kcache[4:8].any()  # sequence 2: positions 67..69 are past 4 pages of 16
    assert not kcache[1, :14].any()
