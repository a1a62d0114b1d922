"""No silent wrong answers: what the runtime is handed (block maps, cached files, gradients,
threads, shapes, re-traced mods) either gives the reference's answer or says why not.

Every kernel runs through Triton's interpreter on CPU: shapes stay tiny.
"""
import os
import sys
import threading
import warnings

import pytest
import torch

import maskc
from maskc import masks, scores
from maskc.runtime import KERNELS
from maskc.runtime.tiles import BackwardConfig, TileConfig, use_config
from maskc.testing import assert_close_to_reference, attention_reference


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "kernels"
    monkeypatch.setenv("MASKC_CACHE_DIR", str(path))
    KERNELS.clear()
    yield path
    KERNELS.clear()


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _qkv(B=1, Hq=2, Hkv=None, Lq=40, Lkv=40, D=16, seed=0):
    Hkv = Hkv or Hq
    return _randn(B, Hq, Lq, D, seed=seed), _randn(B, Hkv, Lkv, D, seed=seed + 1), _randn(B, Hkv, Lkv, D, seed=seed + 2)


def _check(q, k, v, **kwargs):
    out = maskc.compiled_attention(q, k, v, **kwargs)
    kwargs.pop("block_map", None)
    assert_close_to_reference(out, attention_reference(q, k, v, **kwargs)[0])
    return out


# -- 1. a block map is refused for anything but what it was built from ----------------------
def test_block_map_of_another_mask_is_refused():
    q, k, v = _qkv()
    bm = maskc.block_map(masks.causal, 40, 40, block_size=(32, 32))
    with pytest.raises(ValueError) as info:
        maskc.compiled_attention(q, k, v, mask_mod=masks.sliding_window(8), block_map=bm)
    message = str(info.value)
    for word in ("block_map", "causal", "sliding_window_8", "maskc.block_map(sliding_window_8"):
        assert word in message, message


def test_block_map_with_other_parameter_values_is_refused():
    q, k, v = _qkv()
    bm = maskc.block_map(masks.sliding_window(8), 40, 40, block_size=(32, 32))
    with pytest.raises(ValueError) as info:
        maskc.compiled_attention(q, k, v, mask_mod=masks.sliding_window(16), block_map=bm)
    assert "window=8" in str(info.value) and "window=16" in str(info.value), str(info.value)
    _check(q, k, v, mask_mod=masks.sliding_window(8), block_map=bm)  # equal values: accepted


def test_block_map_of_a_changed_or_other_captured_tensor_is_refused():
    q, k, v = _qkv()
    ids = torch.tensor([0] * 20 + [1] * 20)
    mask = masks.document(ids)
    bm = maskc.block_map(mask, 40, 40, block_size=(32, 32))
    _check(q, k, v, mask_mod=mask, block_map=bm)
    with pytest.raises(ValueError, match="another tensor"):
        maskc.compiled_attention(q, k, v, mask_mod=masks.document(ids.clone()), block_map=bm)
    ids[5:25] = 7
    with pytest.raises(ValueError, match="changed in place"):
        maskc.compiled_attention(q, k, v, mask_mod=mask, block_map=bm)


def test_block_map_without_mask_mod_runs_its_own_mask():
    # FlexAttention takes the mask from the BlockMask; a maskless kernel would keep every pair of
    # the PARTIAL tiles
    q, k, v = _qkv(Lq=45, Lkv=50)
    mask = masks.sliding_window(8)
    bm = maskc.block_map(mask, 45, 50, block_size=(16, 32))
    _compare_gradients(lambda q, k, v: maskc.compiled_attention(q, k, v, block_map=bm),
                       lambda q, k, v: attention_reference(q, k, v, mask_mod=mask)[0], (q, k, v))


def _grads(fn, tensors, seed=9):
    """fn's output and the gradients of a random weighting of it, for leaves copied from tensors."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    weights = [_randn(*o.shape, seed=seed + i).to(o.dtype) for i, o in enumerate(outs)]
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    return outs, torch.autograd.grad(loss, leaves)


def _compare_gradients(fn, reference, tensors):
    """fn against the float64 reference: outputs and gradients of q, k, v."""
    outs, grads = _grads(fn, tensors)
    ref_outs, ref_grads = _grads(reference, [t.double() for t in tensors])
    for i, (got, want) in enumerate(zip(outs, ref_outs)):
        empty = torch.isneginf(want)  # lse of rows that keep nothing
        assert torch.equal(torch.isneginf(got), empty), f"output #{i}: -inf where the reference has none, or not"
        assert_close_to_reference(got.detach()[~empty], want.detach()[~empty], torch.float32, f"output #{i}")
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_to_reference(got, want, torch.float32, name)


# -- 2. gradients flow through lse ------------------------------------------------------------
LSE_CASES = [
    (masks.causal, None, 2, 2),
    (masks.sliding_window(5), scores.softcap(4.0), 2, 2),
    (masks.prefix_lm(6), scores.alibi(scores.alibi_slopes(4)), 4, 2),
    (None, None, 2, 1),
    # rows q_idx < 3 keep nothing: lse = -inf there, and the gradient through it is zero
    (maskc.mask_mod(lambda b, h, q_idx, kv_idx: (q_idx >= 3) & (kv_idx <= q_idx), name="late"), None, 2, 2),
]


@pytest.mark.parametrize("mask,score,Hq,Hkv", LSE_CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_gradients_through_lse(mask, score, Hq, Hkv):
    gqa = Hq != Hkv
    _compare_gradients(
        lambda q, k, v: maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=gqa,
                                                 return_lse=True),
        lambda q, k, v: attention_reference(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=gqa),
        _qkv(Hq=Hq, Hkv=Hkv, Lq=37, Lkv=45))


def test_gradients_of_lse_alone():
    mask = LSE_CASES[-1][0]
    q, k, v = (t.requires_grad_() for t in _qkv(Lq=37, Lkv=45))
    _, lse = maskc.compiled_attention(q, k, v, mask_mod=mask, return_lse=True)
    grads = torch.autograd.grad(lse, (q, k, v), torch.ones_like(lse))  # d_out is None in the backward
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, mask_mod=mask)[1]
    ref_grads = torch.autograd.grad(ref, leaves, torch.ones_like(ref), materialize_grads=True)  # v: unused
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.count_nonzero(grads[0][:, :, :3]) == 0
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        if want.norm() == 0:  # lse does not depend on v
            assert torch.count_nonzero(got) == 0, name
        else:
            assert_close_to_reference(got, want, torch.float32, name)


# -- 3. empty inputs keep autograd ------------------------------------------------------------
@pytest.mark.parametrize("B,Bkv,Lq,Lkv", [(1, 1, 0, 10), (1, 1, 10, 0), (0, 0, 10, 10), (2, 1, 10, 0)])
def test_empty_inputs_give_zero_gradients(B, Bkv, Lq, Lkv):
    q = _randn(B, 2, Lq, 16, seed=0).requires_grad_()
    k, v = (_randn(Bkv, 2, Lkv, 16, seed=s).requires_grad_() for s in (1, 2))
    out, lse = maskc.compiled_attention(q, k, v, mask_mod=masks.causal, return_lse=True)
    assert out.shape == (B, 2, Lq, 16) and torch.count_nonzero(out) == 0
    (out.sum() + lse.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and torch.count_nonzero(t.grad) == 0


# -- 4. threads -------------------------------------------------------------------------------
def test_threads_on_cpu_give_the_reference():
    cases = [masks.causal, masks.sliding_window(5), masks.prefix_lm(7), None]
    results, errors = [], []

    def work(i):
        try:
            for j in range(3):
                mask, tensors = cases[(i + j) % len(cases)], _qkv(seed=10 * i + j)
                backward = j == 1
                fn = lambda q, k, v: maskc.compiled_attention(q, k, v, mask_mod=mask)  # noqa: E731
                got = _grads(fn, tensors) if backward else (maskc.compiled_attention(*tensors, mask_mod=mask),)
                results.append((mask, tensors, backward, got))
        except BaseException as e:  # noqa: BLE001 -- re-raised in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(results) == 9
    for mask, tensors, backward, got in results:
        ref = lambda q, k, v: attention_reference(q, k, v, mask_mod=mask)[0]  # noqa: E731
        if backward:
            (out,), grads = got
            (ref_out,), ref_grads = _grads(ref, [t.double() for t in tensors])
            for name, g, want in zip(("dq", "dk", "dv"), grads, ref_grads):
                assert_close_to_reference(g, want, torch.float32, name)
        else:
            out, ref_out = got[0], ref(*tensors)
        assert_close_to_reference(out.detach(), ref_out.detach())


# -- 5. the kernel cache checks what it reads and survives a directory it cannot use ---------
def _kernel():
    return maskc.compile(masks.sliding_window(4), dtype=torch.float32, head_dim=16, device="cpu")


def _run_after(damage, cache_dir):
    """Compile, damage the file, then run from a cold memory cache: the reference's answer,
    one warning naming the file, and the file rendered again."""
    kernel = _kernel()
    good = kernel.path.read_bytes()
    damage(kernel.path)
    KERNELS.clear()
    q, k, v = _qkv(Lq=80)  # more rows than decoding takes: the forward kernel's file runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(q, k, v, mask_mod=masks.sliding_window(4))
        _check(q, k, v, mask_mod=masks.sliding_window(4))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and str(kernel.path) in messages[0], messages
    assert kernel.path.read_bytes() == good
    assert sorted(p.name for p in cache_dir.iterdir()) == [kernel.path.name]  # no temporary files left


def _edit(path):
    # still valid Python: a kernel that keeps every pair of the PARTIAL tiles
    text = path.read_text()
    assert "keep = (" in text
    path.write_text(text.replace("keep = (", "keep = True | (", 1))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _garbage(path):
    path.write_bytes(bytes(range(256)) * 4)


@pytest.mark.parametrize("damage", [_edit, _truncate, _garbage], ids=lambda f: f.__name__.strip("_"))
def test_damaged_kernel_file_is_rendered_again(damage, cache_dir):
    _run_after(damage, cache_dir)


def test_file_edited_after_it_was_read_is_not_run(cache_dir):
    kernel = _kernel()  # read and checked, not yet imported
    _edit(kernel.path)
    q, k, v = _qkv(Lq=80)  # more rows than decoding takes: the forward kernel's file runs
    with pytest.warns(UserWarning, match=str(kernel.path.name)):
        _check(q, k, v, mask_mod=masks.sliding_window(4))


def _unusable(cache_dir, fix, match):
    q, k, v = _qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(q, k, v, mask_mod=masks.causal)
        _check(q, k, v, mask_mod=masks.sliding_window(3))
        kernel = _kernel()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert str(cache_dir) in messages[0] and match in messages[0] and fix in messages[0], messages[0]
    assert kernel.path.parent != cache_dir and kernel.source == kernel.path.read_text()
    assert str(kernel.path.parent) in messages[0]


def test_read_only_cache_directory_falls_back(cache_dir):
    cache_dir.mkdir()
    cache_dir.chmod(0o555)
    try:
        if os.access(cache_dir, os.W_OK):
            pytest.skip("running as root: a read-only directory is still writable")
        _unusable(cache_dir, "MASKC_CACHE_DIR", "temporary directory")
    finally:
        cache_dir.chmod(0o755)


def test_read_only_cache_still_serves_its_kernels(cache_dir):
    path = _kernel().path
    KERNELS.clear()
    cache_dir.chmod(0o555)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _kernel().path == path
    finally:
        cache_dir.chmod(0o755)


def test_cache_directory_that_is_a_file_falls_back(cache_dir):
    cache_dir.write_text("not a directory")
    _unusable(cache_dir, "MASKC_CACHE_DIR", "temporary directory")
    assert cache_dir.read_text() == "not a directory"


# -- 6. k and v with batch 1 broadcast over q's batch ----------------------------------------
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2)])
def test_key_value_batch_broadcasts(Hq, Hkv):
    q = _randn(3, Hq, 37, 16, seed=0)
    k, v = _randn(1, Hkv, 45, 16, seed=1), _randn(1, Hkv, 45, 16, seed=2)
    mask, score, gqa = masks.sliding_window(9), scores.softcap(5.0), Hq != Hkv

    def reference(q, k, v):
        k, v = (t.expand(3, -1, -1, -1) for t in (k, v))
        return attention_reference(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=gqa)

    _compare_gradients(
        lambda q, k, v: maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=gqa,
                                                 return_lse=True),
        reference, (q, k, v))


def test_query_batch_does_not_broadcast():
    q = _randn(1, 2, 40, 16, seed=0)
    k, v = _qkv(B=3)[1:]
    with pytest.raises(ValueError, match="batch"):
        maskc.compiled_attention(q, k, v)


# -- 7. a re-traced mod gets a plan of its new trace --------------------------------------------
WINDOW = 4


def _windowed(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def test_retraced_mask_gets_a_new_plan(monkeypatch):
    mask = maskc.mask_mod(_windowed)
    q, k, v = _qkv()
    _check(q, k, v, mask_mod=mask)
    first = mask.traced
    monkeypatch.setattr(sys.modules[__name__], "WINDOW", 12)  # the mask's guards re-trace it
    out = maskc.compiled_attention(q, k, v, mask_mod=mask)
    assert mask.traced is not first and mask.traced.params[0].value == 12
    assert_close_to_reference(out, attention_reference(q, k, v, mask_mod=masks.sliding_window(12))[0])


def test_backward_uses_the_trace_of_its_forward(monkeypatch):
    # the backward builds its own block map at other tiles: from the forward's trace, not the newest
    mask = maskc.mask_mod(_windowed)
    tiles = TileConfig(16, 16, 4, 1)
    q, k, v = (t.requires_grad_() for t in _qkv())
    with use_config(backward=BackwardConfig(tiles, tiles)):
        out = maskc.compiled_attention(q, k, v, mask_mod=mask)
        monkeypatch.setattr(sys.modules[__name__], "WINDOW", 30)
        d_out = _randn(*out.shape, seed=5)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, mask_mod=masks.sliding_window(4))[0]
    ref_grads = torch.autograd.grad(ref, leaves, d_out.double())
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_to_reference(got, want, torch.float32, name)


def test_a_kernel_whose_shared_memory_does_not_fit_runs_with_fewer_stages():
    # Triton stages a mod's captured-tensor reads in shared memory as well as q, k and v: the
    # Graphormer edge bias's dQ kernel at D=128 asked for 288 KiB of an H100's 227 (a GPU
    # check). The first launch retries with fewer stages; with one, it is an error with a fix.
    from triton.runtime.errors import OutOfResources

    from maskc.runtime.launch import LaunchPlan
    tried = []

    def fn(*args, num_warps, num_stages=None, maxnreg=None):
        tried.append(num_stages)
        if num_stages is None or num_stages > fits:
            raise OutOfResources(294912, 232448, "shared memory")
        return "compiled"
    plan = object.__new__(LaunchPlan)  # a plan around the fake launch above
    plan.fn, plan._what = fn, "attention_bwd_dq of k.py"
    fits, plan._options = 1, dict(num_warps=8, num_stages=3)
    assert plan._fitting([]) == "compiled" and tried == [3, 2, 1]
    assert plan._options["num_stages"] == 1  # later calls launch the variant that fit
    fits, plan._options = 0, dict(num_warps=8, num_stages=2)
    with pytest.raises(maskc.MaskcError, match="shared memory with one pipeline stage.*narrower dtype"):
        plan._fitting([])
    # a Gluon plan (no num_stages: its ring is a constexpr) gets the error as it is, which
    # hopper.failed records for its problem alone
    tried.clear()
    plan._options = dict(num_warps=4, maxnreg=168)
    with pytest.raises(OutOfResources):
        plan._fitting([])
    assert tried == [None]

    def threads(*args, **options):
        raise OutOfResources(2048, 1024, "threads")
    plan.fn, plan._options = threads, dict(num_warps=8, num_stages=3)  # fewer stages would not help
    with pytest.raises(OutOfResources):
        plan._fitting([])


def test_negative_indices_are_wrapped_where_the_call_can_have_them():
    """A negative index counts from the end, as torch's; the select that costs is printed only
    where the call's positions can make an index negative (a relative table read at
    q_idx - kv_idx + 69 is nonnegative with 70 keys, not with 90)."""
    from maskc.runtime.plan import PLANS

    table = _randn(2, 139, seed=5)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 69]

    for Lkv, negative in ((70, False), (90, True)):
        PLANS.clear()
        q, k, v = _qkv(Lq=70, Lkv=Lkv, seed=Lkv)
        _check(q, k, v, score_mod=relative)
        (problem,) = PLANS._items.values()
        assert problem.negative_indices is negative
        assert ("< 0, " in problem.forward_kernel.source) is negative

def test_scores_below_the_log2_range_count_as_minus_infinity():
    """transformers' additive padding puts finfo(float32).min on every key of a padded row. The
    kernels take scores in log2 units, where that is -inf (as FlexAttention's kernel does on an H100): such
    a row is empty, output 0 (README, Semantics). The float64 reference averages it, as
    softmax of equal scores does: it summed v there before (exp(score - lse) with lse's
    rounding absorbing log(n))."""
    lowest = torch.finfo(torch.float32).min
    bias = torch.zeros(20, 24)
    bias[:5] = lowest  # padded rows: every key
    bias[5:, :3] = lowest  # the other rows: the padded keys

    def padding(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx, kv_idx]

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (20, 24, 24))
    ref, _ = attention_reference(q, k, v, score_mod=padding)
    torch.testing.assert_close(ref[:, :, :5], v.double().mean(dim=2, keepdim=True).expand(-1, -1, 5, -1))
    out, lse = maskc.compiled_attention(q, k, v, score_mod=padding, return_lse=True)
    assert (out[:, :, :5] == 0).all() and torch.isneginf(lse[:, :, :5]).all()
    assert_close_to_reference(out[:, :, 5:], ref[:, :, 5:])


# A score below this, in log2 units past float32's range, is -inf in the kernels (FlexAttention's
# compiled kernels read it so too): README, "semantics that differ".
_BELOW_LOG2_RANGE = -torch.finfo(torch.float32).max / 1.4426950408889634


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [40, 1], ids=["prefill", "decode"])
def test_a_row_of_scores_below_the_log2_range_is_empty(dtype, q_len):
    """transformers' additive masks fill dropped pairs with finfo(dtype).min: a padded query row
    has every score there. Such a row is empty (out 0, lse -inf, no gradient), as the rule says,
    and the other rows, whose dropped pairs are as low, agree with the reference."""
    q, k, v = (t.to(dtype) for t in _qkv(Lq=q_len, Lkv=40))
    bias = torch.zeros(1, 1, q_len, 40).masked_fill(torch.rand(1, 1, q_len, 40, generator=torch.Generator()
                                                               .manual_seed(3)) < 0.3, torch.finfo(dtype).min)
    bias[..., 0, :] = torch.finfo(dtype).min  # the first query: padded, every key dropped
    bias[..., 1:, 0] = 0.0  # the others keep a key

    def additive(score, b, h, q_idx, kv_idx):
        return score + bias[b][0][q_idx][kv_idx]

    def as_the_kernels_read(score, b, h, q_idx, kv_idx):
        s = additive(score, b, h, q_idx, kv_idx)
        return torch.where(s < _BELOW_LOG2_RANGE, float("-inf"), s)

    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = maskc.compiled_attention(q, k, v, score_mod=additive, return_lse=True)
    assert torch.all(out[:, :, 0] == 0) and torch.all(torch.isneginf(lse[:, :, 0]))
    ref, ref_lse = attention_reference(q, k, v, score_mod=as_the_kernels_read)
    torch.testing.assert_close(out.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    torch.testing.assert_close(lse[:, :, 1:].double(), ref_lse[:, :, 1:], atol=1e-4, rtol=1e-5)
    if q_len > 1:
        dq, = torch.autograd.grad(out, (q,), torch.ones_like(out))
        assert torch.all(dq[:, :, 0] == 0)


def test_float64_inputs_keep_a_row_of_float32_lowest_scores():
    """In float64 the kernels scale scores in float64, whose range holds float32's lowest times
    log2(e): the row is uniform, as the reference's."""
    q, k, v = (t.double() for t in _qkv(Lq=8, Lkv=40))

    def padded_first_row(score, b, h, q_idx, kv_idx):
        return score + torch.where(q_idx == 0, torch.finfo(torch.float32).min, 0.0)

    out = maskc.compiled_attention(q, k, v, score_mod=padded_first_row)
    ref, _ = attention_reference(q, k, v, score_mod=padded_first_row)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(out[:, :, 0], v.mean(dim=2), atol=1e-9, rtol=0)
