"""No silent wrong answers: what the runtime is handed (block maps, cached files, gradients,
threads, shapes, re-traced mods) either gives the reference's answer or says why not.

Every kernel runs through Triton's interpreter on CPU: shapes stay tiny.
"""
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import maskc
from _inputs import qkv, randn
from maskc import masks, scores
from maskc.runtime import KERNELS, cache
from maskc.runtime.tiles import BackwardConfig, TileConfig, use_config
from maskc.testing import assert_close_to_reference, attention_reference


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "kernels"
    monkeypatch.setenv("MASKC_CACHE_DIR", str(path))
    KERNELS.clear()
    yield path
    KERNELS.clear()


def _check(q, k, v, **kwargs):
    out = maskc.compiled_attention(q, k, v, **kwargs)
    kwargs.pop("block_map", None)
    assert_close_to_reference(out, attention_reference(q, k, v, **kwargs)[0])
    return out


# -- 1. a block map is refused for anything but what it was built from ----------------------
def test_block_map_of_another_mask_is_refused():
    q, k, v = qkv()
    bm = maskc.block_map(masks.causal, 40, 40, block_size=(32, 32))
    with pytest.raises(ValueError) as info:
        maskc.compiled_attention(q, k, v, mask_mod=masks.sliding_window(8), block_map=bm)
    message = str(info.value)
    for word in ("block_map", "causal", "sliding_window_8", "maskc.block_map(sliding_window_8"):
        assert word in message, message


def test_block_map_with_other_parameter_values_is_refused():
    q, k, v = qkv()
    bm = maskc.block_map(masks.sliding_window(8), 40, 40, block_size=(32, 32))
    with pytest.raises(ValueError) as info:
        maskc.compiled_attention(q, k, v, mask_mod=masks.sliding_window(16), block_map=bm)
    assert "window=8" in str(info.value) and "window=16" in str(info.value), str(info.value)
    _check(q, k, v, mask_mod=masks.sliding_window(8), block_map=bm)  # equal values: accepted


def test_block_map_of_a_changed_or_other_captured_tensor_is_refused():
    q, k, v = qkv()
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
    q, k, v = qkv(Lq=45, Lkv=50)
    mask = masks.sliding_window(8)
    bm = maskc.block_map(mask, 45, 50, block_size=(16, 32))
    _compare_gradients(lambda q, k, v: maskc.compiled_attention(q, k, v, block_map=bm),
                       lambda q, k, v: attention_reference(q, k, v, mask_mod=mask)[0], (q, k, v))


def _grads(fn, tensors, seed=9):
    """fn's output and the gradients of a random weighting of it, for leaves copied from tensors."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    weights = [randn(*o.shape, seed=seed + i).to(o.dtype) for i, o in enumerate(outs)]
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
        qkv(Hq=Hq, Hkv=Hkv, Lq=37, Lkv=45))


def test_gradients_of_lse_alone():
    mask = LSE_CASES[-1][0]
    q, k, v = qkv(Lq=37, Lkv=45, requires_grad=True)
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
    q, k, v = qkv(B, Lq=Lq, Lkv=Lkv, Bkv=Bkv, requires_grad=True)
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
                mask, tensors = cases[(i + j) % len(cases)], qkv(seed=10 * i + j)
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
    q, k, v = qkv(Lq=80, Lkv=40)  # more rows than decoding takes: the forward kernel's file runs
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
    q, k, v = qkv(Lq=80, Lkv=40)  # more rows than decoding takes: the forward kernel's file runs
    with pytest.warns(UserWarning, match=str(kernel.path.name)):
        _check(q, k, v, mask_mod=masks.sliding_window(4))


def test_another_kernels_intact_file_under_a_kernels_name_is_rendered_again(cache_dir):
    # a valid sha256 line over another kernel's text: the file must also prove it is the kernel
    # its name says (the maskless kernel under causal's name kept every pair: off by 2.9)
    victim = maskc.compile(masks.causal, dtype=torch.float32, head_dim=16, device="cpu")
    intruder = maskc.compile(None, dtype=torch.float32, head_dim=16, device="cpu")
    good = victim.path.read_bytes()
    victim.path.write_bytes(intruder.path.read_bytes())
    KERNELS.clear()
    q, k, v = qkv(Lq=80, Lkv=40)  # more rows than decoding takes: the forward kernel's file runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(q, k, v, mask_mod=masks.causal)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert str(victim.path) in messages[0] and intruder.path.stem in messages[0], messages[0]
    assert victim.path.read_bytes() == good


def _unusable(cache_dir, fix, match):
    q, k, v = qkv()
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


@contextlib.contextmanager
def _read_only(cache_dir):
    """`cache_dir` made read-only (0o555) for the block, which must bind this process."""
    cache_dir.chmod(0o555)
    try:
        assert not os.access(cache_dir, os.W_OK), f"{cache_dir} is still writable: the check would prove nothing"
        yield
    finally:
        cache_dir.chmod(0o755)


def _falls_back_when_read_only(cache_dir):
    cache_dir.mkdir()
    with _read_only(cache_dir):
        _unusable(cache_dir, "MASKC_CACHE_DIR", "temporary directory")


def _serves_when_read_only(cache_dir):
    path = _kernel().path
    KERNELS.clear()
    with _read_only(cache_dir), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _kernel().path == path


def _bound_by_modes(check, cache_dir):
    """Runs `check(cache_dir)`, a function of this module, in a child process that a directory's
    mode binds. Root writes through a read-only mode (CAP_DAC_OVERRIDE), so as root the child runs
    under setpriv without that capability nor CAP_DAC_READ_SEARCH: still uid 0, it reads what
    root owns by the owner's bits, and a directory of mode 0o555 is read-only to it."""
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root, which writes through a read-only mode, and util-linux's setpriv, which "
                        "runs the check without that capability, is not installed")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]
        probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"running as root, which writes through a read-only mode, and setpriv cannot drop that "
                        f"capability here: {probe.stderr.strip()}")
    code = (f"import pathlib, sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nimport {__name__} as tests\n"
            f"tests.{check.__name__}(pathlib.Path(sys.argv[1]))\n")
    child = subprocess.run([*prefix, sys.executable, "-c", code, str(cache_dir)], capture_output=True, text=True,
                           env={**os.environ, "MASKC_CACHE_DIR": str(cache_dir)})
    assert child.returncode == 0, child.stdout + child.stderr


@pytest.mark.timeout(300)
def test_read_only_cache_directory_falls_back(cache_dir):
    _bound_by_modes(_falls_back_when_read_only, cache_dir)


@pytest.mark.timeout(300)
def test_read_only_cache_still_serves_its_kernels(cache_dir):
    _bound_by_modes(_serves_when_read_only, cache_dir)


def test_cache_directory_that_is_a_file_falls_back(cache_dir):
    cache_dir.write_text("not a directory")
    _unusable(cache_dir, "MASKC_CACHE_DIR", "temporary directory")
    assert cache_dir.read_text() == "not a directory"


def _distrusted(cache_dir, distrust, match, fix):
    """Plant a kernel in `cache_dir` as a process that can write it could (another kernel's text
    under causal's name, its name and sha256 line made to match), `distrust` the directory, then
    run causal: the reference's answer, one warning naming the directory, what is wrong
    with it and the fix, and nothing of the directory read or written."""
    victim = maskc.compile(masks.causal, dtype=torch.float32, head_dim=16, device="cpu")
    intruder = maskc.compile(None, dtype=torch.float32, head_dim=16, device="cpu")
    body = intruder.path.read_text().split("\n", 1)[1].replace(intruder.path.stem, victim.path.stem)
    victim.path.write_text(cache.stamped(body))
    before = sorted(cache_dir.iterdir())
    KERNELS.clear()
    distrust()
    q, k, v = qkv(Lq=80, Lkv=40)  # more rows than decoding takes: the forward kernel's file runs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(q, k, v, mask_mod=masks.causal)
        kernel = _kernel()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    for part in (str(cache_dir), match, fix, str(kernel.path.parent)):
        assert part in messages[0], (part, messages[0])
    assert kernel.path.parent != cache_dir
    assert sorted(cache_dir.iterdir()) == before


def test_cache_directory_writable_by_others_is_not_trusted(cache_dir):
    _distrusted(cache_dir, lambda: cache_dir.chmod(0o777), "mode 0o777: writable by its group or others",
                f"chmod go-w {cache_dir}")


def test_cache_directory_of_another_user_is_not_trusted(cache_dir, monkeypatch):
    def another_owner():
        if os.getuid() == 0:
            os.chown(cache_dir, 54321, -1)  # root trusts only its own directories too
        else:
            uid = os.getuid()
            monkeypatch.setattr(os, "getuid", lambda: uid + 1)

    _distrusted(cache_dir, another_owner, "owned by uid 54321" if os.getuid() == 0 else "owned by uid",
                "set MASKC_CACHE_DIR to a directory you own")


def test_private_cache_directory_in_a_shared_sticky_one_is_trusted(cache_dir, tmp_path):
    shared = tmp_path / "tmp"  # like /tmp: writable by all, sticky
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)
    home = shared / "kernels"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MASKC_CACHE_DIR", str(home))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _kernel().path.parent == home


# -- 6. k and v with batch 1 broadcast over q's batch ----------------------------------------
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2)])
def test_key_value_batch_broadcasts(Hq, Hkv):
    q, k, v = qkv(3, Hq, Hkv, Lq=37, Lkv=45, Bkv=1)
    mask, score, gqa = masks.sliding_window(9), scores.softcap(5.0), Hq != Hkv

    def reference(q, k, v):
        k, v = (t.expand(3, -1, -1, -1) for t in (k, v))
        return attention_reference(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=gqa)

    _compare_gradients(
        lambda q, k, v: maskc.compiled_attention(q, k, v, mask_mod=mask, score_mod=score, enable_gqa=gqa,
                                                 return_lse=True),
        reference, (q, k, v))


def test_query_batch_does_not_broadcast():
    q = randn(1, 2, 40, 16, seed=0)
    k, v = qkv(B=3)[1:]
    with pytest.raises(ValueError, match="batch"):
        maskc.compiled_attention(q, k, v)


# -- 7. a re-traced mod gets a plan of its new trace --------------------------------------------
WINDOW = 4


def _windowed(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def test_retraced_mask_gets_a_new_plan(monkeypatch):
    mask = maskc.mask_mod(_windowed)
    q, k, v = qkv()
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
    q, k, v = qkv(requires_grad=True)
    with use_config(backward=BackwardConfig(tiles, tiles)):
        out = maskc.compiled_attention(q, k, v, mask_mod=mask)
        monkeypatch.setattr(sys.modules[__name__], "WINDOW", 30)
        d_out = randn(*out.shape, seed=5)
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

    table = randn(2, 139, seed=5)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 69]

    for Lkv, negative in ((70, False), (90, True)):
        PLANS.clear()
        q, k, v = qkv(Lq=70, Lkv=Lkv, seed=Lkv)
        _check(q, k, v, score_mod=relative)
        (problem,) = PLANS._items.values()
        assert problem.negative_indices is negative
        assert ("< 0, " in problem.forward_kernel.source) is negative

def test_scores_below_the_log2_range_count_as_minus_infinity():
    """transformers' additive padding puts finfo(float32).min on every key of a padded row. The
    kernels take scores in log2 units, where that is -inf (as FlexAttention's kernel does on an H100): such
    a row is empty, output 0 (docs/guides/masks.md). The float64 reference averages it, as
    softmax of equal scores does: it summed v there before (exp(score - lse) with lse's
    rounding absorbing log(n))."""
    lowest = torch.finfo(torch.float32).min
    bias = torch.zeros(20, 24)
    bias[:5] = lowest  # padded rows: every key
    bias[5:, :3] = lowest  # the other rows: the padded keys

    def padding(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx, kv_idx]

    q, k, v = qkv(Lq=20, Lkv=24)
    ref, _ = attention_reference(q, k, v, score_mod=padding)
    torch.testing.assert_close(ref[:, :, :5], v.double().mean(dim=2, keepdim=True).expand(-1, -1, 5, -1))
    out, lse = maskc.compiled_attention(q, k, v, score_mod=padding, return_lse=True)
    assert (out[:, :, :5] == 0).all() and torch.isneginf(lse[:, :, :5]).all()
    assert_close_to_reference(out[:, :, 5:], ref[:, :, 5:])


# A score below this, in log2 units past float32's range, is -inf in the kernels (FlexAttention's
# compiled kernels read it so too): docs/guides/masks.md, "Where maskc's answer differs from FlexAttention's".
_BELOW_LOG2_RANGE = -torch.finfo(torch.float32).max / 1.4426950408889634


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [40, 1], ids=["prefill", "decode"])
def test_a_row_of_scores_below_the_log2_range_is_empty(dtype, q_len):
    """transformers' additive masks fill dropped pairs with finfo(dtype).min: a padded query row
    has every score there. Such a row is empty (out 0, lse -inf, no gradient), as the rule says,
    and the other rows, whose dropped pairs are as low, agree with the reference."""
    q, k, v = qkv(Lq=q_len, Lkv=40, dtype=dtype)
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
    q, k, v = qkv(Lq=8, Lkv=40, dtype=torch.float64)

    def padded_first_row(score, b, h, q_idx, kv_idx):
        return score + torch.where(q_idx == 0, torch.finfo(torch.float32).min, 0.0)

    out = maskc.compiled_attention(q, k, v, score_mod=padded_first_row)
    ref, _ = attention_reference(q, k, v, score_mod=padded_first_row)
    torch.testing.assert_close(out, ref, atol=1e-9, rtol=0)
    torch.testing.assert_close(out[:, :, 0], v.mean(dim=2), atol=1e-9, rtol=0)
