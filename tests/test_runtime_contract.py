"""The runtime contract (maskc/runtime): one block map per call read by every kernel at its own
tiles, launches bound by parameter name, tiles validated by one owner, settings in one module."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from triton.runtime.errors import InterpreterError

import maskc
import maskc.codegen
from _inputs import randn
from maskc import masks, scores
from maskc.analysis.classify import EMPTY, FULL, PARTIAL
from maskc.runtime import kernel as kernel_module
from maskc.runtime import launch
from maskc.runtime.kernel import kernel_for
from maskc.runtime.tiles import BackwardConfig, TileConfig, check_block_size, choose, use_config
from maskc.settings import SETTINGS
from maskc.testing import assert_close_to_reference, attention_reference

ROOT = Path(__file__).resolve().parents[1]


# -- one map, any kernel tiles ---------------------------------------------------------------
MASKS = [masks.causal, masks.sliding_window(13), masks.document(torch.tensor([0] * 30 + [1] * 25 + [2] * 22)),
         masks.prefix_lm(20)]


@pytest.mark.parametrize("map_tiles", [(16, 16), (64, 64), (128, 16), (16, 128), (256, 32)],
                         ids=lambda t: f"map{t[0]}x{t[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.__name__)
def test_a_map_at_any_tiles_drives_the_kernels(mask, map_tiles):
    # lengths past a multiple of every tile: a map tile may end past the last kernel tile
    Lq, Lkv = 77, 77
    q, k, v = (randn(1, 2, L, 32, seed=i).requires_grad_() for i, L in enumerate((Lq, Lkv, Lkv)))
    bm = maskc.block_map(mask, Lq, Lkv, block_size=map_tiles)
    d_out = randn(1, 2, Lq, 32, seed=9)
    with use_config(backward=BackwardConfig(TileConfig(64, 16, 4, 1), TileConfig(16, 32, 4, 1))):
        out = maskc.compiled_attention(q, k, v, block_map=bm)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), mask_mod=mask)
    assert_close_to_reference(out, ref)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), d_out.double())):
        assert_close_to_reference(got, want)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("factors", [(2, 1), (1, 4), (4, 2), (8, 8)])
def test_a_coarsened_map_is_the_map_analysed_at_that_size(mask, factors):
    fine = maskc.block_map(mask, 77, 70, block_size=(16, 16))
    coarse = fine.coarsened(*factors)
    direct = maskc.block_map(mask, 77, 70, block_size=(16 * factors[0], 16 * factors[1]))
    assert coarse.block_size == direct.block_size
    assert torch.equal(coarse.to_dense(), direct.to_dense())
    assert fine.coarsened(*factors) is coarse  # built once per map


def test_for_tiles_reads_a_coarser_map_with_multiples_and_coarsens_a_finer_one():
    bm = maskc.block_map(masks.causal, 256, 256, block_size=(64, 64))
    assert bm.for_tiles(32, 16) == (bm, 2, 4)
    coarse, q_multiple, kv_multiple = bm.for_tiles(128, 32)
    assert (coarse.block_size, q_multiple, kv_multiple) == ((128, 64), 1, 2)
    # 128-row tiles over 64-column ones: the diagonal's two columns PARTIAL, below FULL, above EMPTY
    assert coarse.to_dense()[0, 0].tolist() == [[PARTIAL, PARTIAL, EMPTY, EMPTY], [FULL, FULL, PARTIAL, PARTIAL]]


def test_tiles_have_one_rule():
    assert check_block_size(32) == (32, 32)
    for bad in [(0, 16), (48, 16), (16, 512), (16,), "64", (True, 16)]:
        with pytest.raises(ValueError, match="powers of two from 16 to 256"):
            check_block_size(bad)
    chosen = choose(64, "cpu", 4, block_map_size=(128, 128))
    assert chosen.sparse == (128, 128)
    assert choose(64, "cpu", 4).sparse == (chosen.forward.block_m, chosen.forward.block_n)
    q = randn(1, 1, 40, 32, seed=0)
    bm = maskc.block_map(masks.causal, 40, 40, block_size=(48, 32))
    with pytest.raises(ValueError, match="block_map tile sizes must be two powers of two"):
        maskc.compiled_attention(q, q, q, block_map=bm)
    with pytest.raises(ValueError, match="block_size sizes must be two powers of two"):
        maskc.compile(masks.causal, block_size=(24, 24), device="cpu")


# -- launches bind by name -------------------------------------------------------------------
def test_rendering_returns_each_kernels_parameters_in_order():
    kernel = kernel_for("fwd", masks.document(torch.tensor([0, 1])).traced, scores.softcap(5.0).traced,
                        torch.float32, torch.device("cpu"))
    params = kernel.parameters["attention_fwd"]
    assert params[:5] == ("Q", "K", "V", "Out", "Lse")
    # the captured tensor's pointer, stride and size, then the mask's and score's values
    assert [p for p in params if re.fullmatch(r"T0\w*|p\d", p)] == ["T0", "T0_stride0", "T0_size0", "p0"]
    header = kernel.source.split("def attention_fwd(")[1].split("):")[0]
    assert [a.split(":")[0].strip() for a in header.split(",") if a.strip()] == list(params)


def test_a_launch_missing_an_argument_names_it():
    kernel = kernel_for("fwd", masks.causal.traced, None, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"no value for \['K'\].*does not have \['bogus'\]"):
        launch.LaunchPlan(kernel, "attention_fwd", True, (1, 1), {"bogus": 1}, tuple(
            p for p in kernel.parameters["attention_fwd"] if p != "K"), {})


# -- settings ----------------------------------------------------------------------------------
def test_every_environment_knob_is_in_settings_and_the_settings_guide():
    listed = {s.name for s in SETTINGS}
    read = set()
    for path in (ROOT / "maskc").rglob("*.py"):
        read |= set(re.findall(r"\b(MASKC_[A-Z_]+)\b", path.read_text()))
    assert read == listed, "every MASKC_ variable maskc reads is a Setting in maskc/settings.py"
    guide = (ROOT / "docs" / "guides" / "settings.md").read_text()
    for name in listed:
        assert f"`{name}`" in guide, f"{name} missing from docs/guides/settings.md's settings table"
    environ = [p for p in (ROOT / "maskc").rglob("*.py") if "os.environ" in p.read_text()]
    # loader.py sets TRITON_INTERPRET around an import: Triton's switch, not a setting of maskc's
    assert sorted(p.name for p in environ) == ["loader.py", "settings.py"]


def test_old_names_still_work_and_say_what_replaced_them():
    with pytest.warns(DeprecationWarning, match="KernelSource"):
        assert maskc.codegen.KernelSpec is maskc.codegen.KernelSource
    kernel = maskc.compile(masks.causal, device="cpu")
    with pytest.warns(DeprecationWarning, match="kernel_source"):
        assert kernel.spec is kernel.kernel_source


def test_an_interpreter_too_old_for_numpy_says_so(monkeypatch):
    # Triton 3.6's interpreter with numpy >= 2.4 (the GPU image's pair) fails inside Triton
    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise InterpreterError("TypeError('only 0-dimensional arrays can be converted to Python scalars')")
            return launch

    monkeypatch.setattr(kernel_module, "_NUMPY", (2, 5))
    with pytest.raises(RuntimeError, match=r"numpy<2.4' or a newer Triton"):
        kernel_module._Interpreted(Failing())[(1,)]()
    monkeypatch.setattr(kernel_module, "_NUMPY", (2, 3))
    with pytest.raises(InterpreterError):  # another cause: Triton's own error, untouched
        kernel_module._Interpreted(Failing())[(1,)]()
