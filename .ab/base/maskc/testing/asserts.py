"""Assertions about block maps and attention outputs, for users' tests and ours."""
from __future__ import annotations

import torch

from maskc.analysis.build import block_map as _block_map
from maskc.testing.reference import dense_mask, dense_tiles


def _maps(mask_mod, q_len, kv_len, block_size, B, H):
    bm = _block_map(mask_mod, q_len, kv_len, block_size=block_size, B=B, H=H)
    got = bm.to_dense().cpu().expand(B or 1, H or 1, -1, -1)
    want = dense_tiles(dense_mask(mask_mod, q_len, kv_len, B or 1, H or 1), block_size)
    return bm, got, want


def _where(diff) -> str:
    idx = diff.nonzero()[:5].tolist()
    return ", ".join(f"(b={b}, h={h}, q_tile={i}, kv_tile={j})" for b, h, i, j in idx)


def assert_block_map_sound(mask_mod, q_len: int, kv_len: int, block_size=(128, 128), B=None, H=None):
    """Every FULL tile keeps all its pairs and every EMPTY tile none, by dense evaluation."""
    _, got, want = _maps(mask_mod, q_len, kv_len, block_size, B, H)
    wrong_full = (got == 2) & (want != 2)
    wrong_empty = (got == 0) & (want != 0)
    if wrong_full.any() or wrong_empty.any():
        raise AssertionError(f"block map of {getattr(mask_mod, '__name__', mask_mod)} is unsound at "
                             f"q_len={q_len}, kv_len={kv_len}, block_size={block_size}: "
                             f"FULL but not all kept at {_where(wrong_full)}; "
                             f"EMPTY but some kept at {_where(wrong_empty)}")


def assert_block_map_exact(mask_mod, q_len: int, kv_len: int, block_size=(128, 128), B=None, H=None):
    """The block map equals the verdicts of dense evaluation tile by tile."""
    assert_block_map_sound(mask_mod, q_len, kv_len, block_size, B, H)
    _, got, want = _maps(mask_mod, q_len, kv_len, block_size, B, H)
    if not torch.equal(got, want):
        raise AssertionError(f"block map of {getattr(mask_mod, '__name__', mask_mod)} is sound but not exact at "
                             f"q_len={q_len}, kv_len={kv_len}, block_size={block_size}: "
                             f"PARTIAL where dense says FULL or EMPTY at {_where(got != want)}")


def assert_gradient_close_to_reference(got, want, dtype, what: str) -> None:
    """assert_close_to_reference with a floor under the reference's norm (an RMS of 1e-3 per
    element): a gradient that is 0 in exact arithmetic (a row keeping one key has ds = 0) is
    rounding noise in half precision, whose relative error is unbounded."""
    floor = 1e-3 * want.numel() ** 0.5
    if want.double().norm() >= floor:
        assert_close_to_reference(got, want, dtype, what=what)
        return
    err = (got.double() - want.double()).norm() / floor
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}.get(dtype, 1e-3)
    assert err <= tol, f"{what} error {float(err):.3e} (against a floor of {floor:.1e}) exceeds {tol:.0e}"


def assert_close_to_reference(out, ref, dtype=None, what="output"):
    """Relative error ‖out − ref‖ / ‖ref‖ under the tolerance of `dtype`; NaN never passes."""
    dtype = dtype or out.dtype
    tol = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}[dtype]
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    if torch.isnan(out64).any():
        raise AssertionError(f"{what} has NaN at {torch.isnan(out64).nonzero()[:3].tolist()}")
    err = (out64 - ref64).norm() / ref64.norm().clamp(min=1e-30)
    if err > tol:
        raise AssertionError(f"{what} relative error {float(err):.3e} exceeds {tol:.0e} for {dtype}")
