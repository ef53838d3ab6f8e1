"""cutemk.nn.MegaMLP as a drop-in for Hugging Face gated MLPs.

CPU tests run the interpreter backend against the module it replaces (in fp32); the GPU test
runs the megakernel against transformers' Qwen3MLP and checks that every token count up to
max_tokens is served by at most two compiled kernels (the decode and prefill regimes).
"""

import copy

import pytest
import torch
from torch import nn

import cutemk as mk
from cutemk.nn import DECODE_MAX_TOKENS, MegaMLP, mlp_tiles

H, I = 64, 96
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class HFLikeMLP(nn.Module):
    """The layout of Qwen3MLP / LlamaMLP / MistralMLP, without depending on transformers."""

    def __init__(self, hidden=H, inter=I, bias=False, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in the output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def fp32_reference(mlp, x):
    with torch.no_grad():
        return copy.deepcopy(mlp).float()(x.float())


@pytest.fixture
def hf_mlp():
    torch.manual_seed(0)
    return HFLikeMLP()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_mlp(hf_mlp, dtype):
    mlp = hf_mlp.to(dtype)
    mega = MegaMLP.from_hf(mlp, max_tokens=512)
    for t in (1, 5, 64, 300):
        x = torch.randn(t, H).to(dtype)
        y = mega(x)
        assert y.shape == (t, H) and y.dtype == dtype
        assert rel_err(y, fp32_reference(mlp, x)) < TOL[dtype], f"T={t}"
    # all four regimes served, each compiled once for all four token counts (the compiled
    # graphs are shared by the modules of one key, here per dtype)
    mine = [k for k in mega._compiled if k[2] == dtype]
    assert {k[1] for k in mine} == {"gemv1", "gemv", "decode", "prefill"} and len(mine) == 4


def test_leading_dims_and_empty(hf_mlp):
    mega = MegaMLP.from_hf(hf_mlp, max_tokens=512)
    x = torch.randn(2, 3, H)
    y = mega(x)
    assert y.shape == (2, 3, H)
    assert rel_err(y, fp32_reference(hf_mlp, x)) < 1e-5
    assert mega(torch.randn(0, H)).shape == (0, H)
    assert mega(torch.randn(2, 0, H)).shape == (2, 0, H)
    # a non-contiguous view (every other token) is accepted and gives the same rows
    xs = torch.randn(8, H)[::2]
    assert rel_err(mega(xs), fp32_reference(hf_mlp, xs)) < 1e-5


def test_requires_grad_input_runs_without_grad(hf_mlp):
    mega = MegaMLP.from_hf(hf_mlp, max_tokens=64)
    x = torch.randn(4, H, requires_grad=True)
    y = mega(x)
    assert not y.requires_grad
    assert rel_err(y, fp32_reference(hf_mlp, x.detach())) < 1e-5


def test_regimes_and_tiles(hf_mlp):
    small = MegaMLP.from_hf(hf_mlp, max_tokens=DECODE_MAX_TOKENS)
    assert small.regimes() == ("gemv1", "gemv", "decode")
    assert MegaMLP.from_hf(hf_mlp, max_tokens=16).regimes() == ("gemv1", "gemv")
    assert MegaMLP.from_hf(hf_mlp, max_tokens=1).regimes() == ("gemv1",)
    small(torch.randn(DECODE_MAX_TOKENS, H))
    with pytest.raises(ValueError, match="regime"):
        small.compiled("prefill")
    big = MegaMLP.from_hf(hf_mlp, max_tokens=512)
    assert big.regime(1) == "gemv1" and big.regime(2) == big.regime(16) == "gemv"
    assert big.regime(17) == big.regime(DECODE_MAX_TOKENS) == "decode"
    assert big.regime(DECODE_MAX_TOKENS + 1) == "prefill"
    # 128-row tiles from 17 tokens on: a 64-row tile reads each weight column twice at 128
    assert mlp_tiles("decode")[0][0] == 128 and mlp_tiles("prefill")[0][0] == 128
    assert mlp_tiles("decode", "interpret") == ((16, 32), (16, 32))
    with pytest.raises(ValueError, match="no MLP tiles"):
        mlp_tiles("warmup")


def test_decode_gate_up_width_fits_the_waves():
    """The unsplit decode gate/up tile is as wide as makes its busiest SM stream the fewest
    weight columns: one wave of 96-column tiles for Qwen3-8B (not 1.45 waves of 64), 112 for
    Qwen3-32B and LLaMA-3.1-8B; narrow tiles where even those leave SMs idle."""
    from cutemk.nn import wave_fit_width

    assert wave_fit_width(12288, 1, 132) == 96  # 128 tiles
    assert wave_fit_width(25600, 1, 132) == 112  # 229 tiles: 2 of 112 vs 4 waves of 64
    assert wave_fit_width(14336, 1, 132) == 112  # 128 tiles
    assert wave_fit_width(3072, 1, 132) == 64  # 48 tiles either way: the narrowest
    assert wave_fit_width(128 * 132, 1, 132) == 128  # a tie goes to the wider tile


def test_state_dict_and_to(hf_mlp):
    mega = MegaMLP.from_hf(hf_mlp, max_tokens=64)
    sd = mega.state_dict()
    assert set(sd) == {"w_gate_up", "w_down"}
    assert sd["w_gate_up"].shape == (2 * I, H) and sd["w_down"].shape == (H, I)
    torch.testing.assert_close(sd["w_gate_up"][:I], hf_mlp.gate_proj.weight.detach())
    other = MegaMLP(torch.zeros(I, H), torch.zeros(I, H), torch.zeros(H, I), max_tokens=64)
    other.load_state_dict(sd)
    x = torch.randn(3, H)
    torch.testing.assert_close(other(x), mega(x))
    # casting the module recompiles for the new dtype on the next call
    mega.to(torch.bfloat16)
    y = mega(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert rel_err(y, fp32_reference(hf_mlp, x)) < 2e-2


def test_constructor_from_tensors(hf_mlp):
    w = [hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight, hf_mlp.down_proj.weight]
    mega = MegaMLP(*w, max_tokens=32, scheduler="dynamic", num_sms=4, backend="interpret")
    x = torch.randn(20, H)
    assert rel_err(mega(x), fp32_reference(hf_mlp, x)) < 1e-5
    assert mega.compiled("decode").num_sms == 4


def test_refuses_what_it_cannot_compute(hf_mlp):
    with pytest.raises(ValueError, match="bias"):
        MegaMLP.from_hf(HFLikeMLP(bias=True))
    with pytest.raises(ValueError, match="not SiLU"):
        MegaMLP.from_hf(HFLikeMLP(act=nn.GELU()))
    no_act = HFLikeMLP()
    del no_act.act_fn
    with pytest.raises(ValueError, match="hidden_act"):
        MegaMLP.from_hf(no_act)
    no_act.config = type("Cfg", (), {"hidden_act": "swish"})()
    MegaMLP.from_hf(no_act)  # a SiLU config is enough without act_fn
    del no_act.gate_proj
    with pytest.raises(ValueError, match="gate_proj"):
        MegaMLP.from_hf(no_act)
    with pytest.raises(mk.ShapeError, match="w_down"):
        MegaMLP(torch.randn(I, H), torch.randn(I, H), torch.randn(H, I + 1))
    with pytest.raises(mk.ShapeError, match="w_up"):
        MegaMLP(torch.randn(I, H), torch.randn(I, H + 1), torch.randn(H, I))
    with pytest.raises(mk.DTypeError, match="one dtype"):
        MegaMLP(torch.randn(I, H), torch.randn(I, H).bfloat16(), torch.randn(H, I))
    with pytest.raises(ValueError, match="max_tokens"):
        MegaMLP.from_hf(hf_mlp, max_tokens=0)
    with pytest.raises(mk.ShapeError, match="at least 1"):  # was a ZeroDivisionError at a call
        MegaMLP(torch.randn(4, 0), torch.randn(4, 0), torch.randn(0, 4))


def test_bad_inputs(hf_mlp):
    mega = MegaMLP.from_hf(hf_mlp, max_tokens=16)
    with pytest.raises(mk.ShapeError, match="max_tokens=16"):
        mega(torch.randn(17, H))
    with pytest.raises(mk.ShapeError, match="max_tokens=16"):
        mega(torch.randn(3, 6, H))  # 18 tokens once flattened
    with pytest.raises(mk.DTypeError, match="bfloat16"):
        mega(torch.randn(4, H).bfloat16())
    with pytest.raises(mk.ShapeError, match=f"\\(\\.\\.\\., {H}\\)"):
        mega(torch.randn(4, H + 1))
    with pytest.raises(TypeError):
        mega([[0.0] * H])


def test_transformers_qwen3_mlp_cpu():
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    torch.manual_seed(0)
    mlp = qwen3.Qwen3MLP(Qwen3Config(hidden_size=H, intermediate_size=I)).to(torch.bfloat16)
    mega = MegaMLP.from_hf(mlp, max_tokens=512)
    for t in (1, 5, 64, 300):
        x = torch.randn(t, H).bfloat16()
        assert rel_err(mega(x), fp32_reference(mlp, x)) < 2e-2, f"T={t}"


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static", "dynamic"])
def test_qwen3_mlp_megakernel(scheduler):
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    from cutemk import runtime

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072)
    mlp = qwen3.Qwen3MLP(cfg).to("cuda", torch.bfloat16)
    ref_mlp = copy.deepcopy(mlp).float()
    mega = MegaMLP.from_hf(mlp, max_tokens=8192, scheduler=scheduler)
    assert mega.resolved_backend() == "cute"
    before = runtime.compile_count
    for t in (1, 5, 64, 128, 129, 300, 8192):
        x = torch.randn(t, 1024, device="cuda").bfloat16()
        with torch.no_grad():
            ref = ref_mlp(x.float())
        assert rel_err(mega(x), ref) <= 2e-2, f"T={t}"
    # gemv1, gemv, decode, prefill: every token count
    assert runtime.compile_count - before <= 4
    with pytest.raises(mk.ShapeError, match="max_tokens=8192"):
        mega(torch.randn(8193, 1024, device="cuda").bfloat16())


def test_eager_fast_path_is_keyed_by_shape_dtype_and_the_weights(hf_mlp):
    """A second eager call with rows of one shape skips the module's checks; anything that
    could change the answer (weights replaced, dtype, autograd, a copy) takes the full path."""
    mlp = MegaMLP.from_hf(hf_mlp, max_tokens=32, backend="interpret")
    row = torch.randn(1, H)
    assert rel_err(mlp(row), fp32_reference(hf_mlp, row)) < TOL[torch.float32]
    seen = []
    mlp._fast[row.shape] = (lambda a: seen.append(a), *mlp._fast[row.shape][1:])
    odd = torch.randn(H, 1).T  # (1, H) with strides (1, 1): "contiguous" to torch
    assert rel_err(mlp(odd), fp32_reference(hf_mlp, odd)) < TOL[torch.float32]
    assert not seen  # not the fast path: the kernel's loads need row-major strides
    x = torch.randn(5, H)
    assert rel_err(mlp(x), fp32_reference(hf_mlp, x)) < TOL[torch.float32]
    assert x.shape in mlp._fast
    x2 = torch.randn(5, H)
    run = mlp._fast[x.shape][0]
    calls = []
    mlp._fast[x.shape] = (lambda a: calls.append(a) or run(a), *mlp._fast[x.shape][1:])
    assert rel_err(mlp(x2), fp32_reference(hf_mlp, x2)) < TOL[torch.float32]
    assert len(calls) == 1 and calls[0][0] is x2  # the fast path ran
    assert "_fast" not in copy.deepcopy(mlp).__dict__  # a copy remembers no launch
    mlp.scheduler = "dynamic"  # another configuration: the launches remembered go
    assert "_fast" not in mlp.__dict__
    mlp(x2)
    assert len(calls) == 1
    for name, value in (("num_sms", 3), ("backend", "interpret"), ("profile", False)):
        mlp(x2)
        assert x2.shape in mlp._fast
        setattr(mlp, name, value)  # each forgets them: the fast path compares none per call
        assert "_fast" not in mlp.__dict__, name
    mlp.num_sms = None
    mlp.scheduler = "static"
    mlp.w_down = mlp.w_down.clone()  # a buffer replaced: its identity differs from the kept one
    mlp(x2)
    kept = mlp._fast[x2.shape]
    mlp._buffers["w_down"] = mlp.w_down.clone()  # even behind setattr's back
    mlp._fast[x2.shape] = (lambda a: calls.append(a), *kept[1:])
    mlp(x2)
    assert len(calls) == 1
    with pytest.raises(mk.errors.DTypeError):
        mlp(x.bfloat16())
    mlp(x)
    mlp.bfloat16()  # new weight tensors: the remembered launches (and old weights) go
    assert "_fast" not in mlp.__dict__
    with pytest.raises(mk.errors.DTypeError):
        mlp(x)
    y = mlp(x.bfloat16().requires_grad_())
    assert not y.requires_grad


def test_forward_live_on_the_interpreter(hf_mlp):
    """The live-count path's reference: rows below the count are the MLP of those rows, rows
    past the plan the device would run untouched; shapes, the count's type and range give
    clear errors."""
    mlp = MegaMLP.from_hf(hf_mlp, max_tokens=20, backend="interpret")
    x = torch.randn(20, H)
    for n in (1, 7, 20, 0):
        out = torch.full_like(x, float("nan"))
        y = mlp(x, num_tokens=torch.tensor([n], dtype=torch.int32))
        y2 = mlp.forward_live(x, torch.tensor([n], dtype=torch.int32), out=out)
        assert y2 is out and torch.isnan(out[mlp.live_plan_count(n) if n else 0 :]).all()
        if n:
            assert rel_err(y[:n], fp32_reference(hf_mlp, x[:n])) < TOL[torch.float32]
            assert torch.equal(y2[:n], y[:n])
    y3 = mlp(x.reshape(4, 5, H), num_tokens=torch.tensor([9], dtype=torch.int32))
    assert y3.shape == (4, 5, H)
    with pytest.raises(mk.errors.LayoutError, match="max_tokens=20"):
        mlp(x[:19], num_tokens=torch.tensor([3], dtype=torch.int32))
    # a 0-d x (an IndexError) and one that is not a tensor (an AttributeError) are named
    with pytest.raises(mk.errors.LayoutError, match="max_tokens=20"):
        mlp(torch.tensor(1.0), num_tokens=torch.tensor([1], dtype=torch.int32))
    for bad in (None, x.tolist()):
        with pytest.raises(TypeError, match="input must be a torch.Tensor"):
            mlp(bad, num_tokens=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        mlp(x, num_tokens=torch.tensor([3]))
    with pytest.raises(mk.errors.CuteMKError, match="outside"):
        mlp(x, num_tokens=torch.tensor([21], dtype=torch.int32))
    # ``out`` and the count are checked as the GPU path checks them (the reference took an
    # int32 out and truncated, and returned a 2-row out whole)
    n3 = torch.tensor([3], dtype=torch.int32)
    for bad in (torch.empty(20, H, dtype=torch.int32), torch.empty(2, H), torch.empty(H, 20).T):
        with pytest.raises(mk.errors.LayoutError, match="out must be a contiguous"):
            mlp.forward_live(x, n3, out=bad)
    with pytest.raises(mk.errors.DeviceError, match="num_tokens is on meta"):
        mlp.forward_live(x, torch.tensor([3], dtype=torch.int32, device="meta"))
    with pytest.raises(mk.errors.LayoutError, match="contiguous rows"):
        mlp.forward_live(torch.randn(H, 20).T, n3)
