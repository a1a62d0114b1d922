"""The kernel cache: one kernel per canonical expression, shared across values, kept on disk."""
import importlib
import importlib.util
import json
import os
import py_compile
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.runtime.cache

import maskc
from _inputs import qkv
from maskc import masks, scores, settings
from maskc.cli import main
from maskc.codegen.printer import TritonPrinter
from maskc.codegen.render import render
from maskc.codegen.source import KernelSource
from maskc.runtime import KERNELS, cache, loader, plan
from maskc.runtime.kernel import provenance
from maskc.runtime.tiles import BackwardConfig, TileConfig, use_config
from maskc.testing import assert_close_to_reference, attention_reference
from maskc.trace.mods import as_mask_mod, as_score_mod


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "kernels"
    monkeypatch.setenv("MASKC_CACHE_DIR", str(path))
    monkeypatch.delenv("MASKC_DEBUG", raising=False)
    KERNELS.clear()
    plan.BLOCK_MAPS.clear()
    yield path
    KERNELS.clear()


def _compile(mask=None, score=None, **kwargs):
    kwargs = {"dtype": torch.float32, "head_dim": 32, "device": "cpu", **kwargs}
    return maskc.compile(mask_mod=mask, score_mod=score, **kwargs)


def _run_and_check(q, k, v, **kwargs):
    out = maskc.compiled_attention(q, k, v, **kwargs)
    kwargs.pop("block_map", None)
    ref, _ = attention_reference(q, k, v, **kwargs)
    assert_close_to_reference(out, ref)
    return out


# -- what a kernel is -----------------------------------------------------------------------
def test_source_is_the_file_that_runs(cache_dir):
    kernel = _compile(masks.sliding_window(8), scores.softcap(20.0))
    assert isinstance(kernel, maskc.CompiledKernel)
    assert kernel.path.parent == cache_dir
    assert kernel.source == kernel.path.read_text()
    assert "@triton.jit" in kernel.source
    compile(kernel.source, str(kernel.path), "exec")  # valid Python as written


def test_files_define_only_the_helpers_they_call():
    causal = _compile(masks.causal).source
    for helper in ("_floordiv", "_ceildiv", "_truncdiv", "_mod", "_tanh", "_atan", "_sign", "_lshift", "_rshift", "_widen"):
        assert f"def {helper}(" not in causal
    assert "_max_combine = tl.standard._elementwise_max" in causal  # the interpreter reduces these with numpy

    def blocks(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) // 8 == 0

    floor = _compile(blocks).source  # q_idx - kv_idx may be negative: Python's floor through _floordiv
    assert "_floordiv(" in floor and "def _floordiv(" in floor and "def _mod(" not in floor
    softcap = _compile(masks.causal, scores.softcap(20.0)).source
    assert "def _tanh(" in softcap and "def _floordiv(" not in softcap
    # a helper that calls another brings it along
    truncated = _compile(None, lambda score, b, h, q_idx, kv_idx: score * torch.div(
        q_idx - kv_idx, 3, rounding_mode="trunc")).source
    assert "def _truncdiv(" in truncated and "def _floordiv(" in truncated


def test_one_file_per_distinct_text(cache_dir):
    kernel = _compile(masks.causal)
    assert re.fullmatch(r"fwd_[0-9a-f]{16}\.py", kernel.path.name), kernel.path.name
    assert kernel.path.stem.endswith(kernel.signature)
    # dtype, head dim and tiles are launch values (constexprs, pointer types): the same text
    other = _compile(masks.causal, dtype=torch.float16, head_dim=64, block_size=(16, 128))
    assert (other.path, other.source) == (kernel.path, kernel.source)
    # and running it at other tiles and dtypes writes no other file
    q, k, v = qkv(D=32)
    with use_config(forward=TileConfig(16, 64, 4, 1), backward=BackwardConfig(TileConfig(16, 32, 4, 1),
                                                                                  TileConfig(64, 16, 4, 1))):
        for dtype in (torch.float32, torch.float16):
            x, y, z = (t.to(dtype).requires_grad_() for t in (q, k, v))
            out = _run_and_check(x, y, z, mask_mod=masks.causal)
            out.sum().backward()
    names = sorted(p.name for p in cache_dir.iterdir() if p.suffix == ".py")
    assert len(names) == 2 and kernel.path.name in names and names[0][:4] != names[1][:4]  # fwd_ and bwd_
    # float64 inputs run a separable score as written: that text differs, so does the file
    alibi = scores.alibi(scores.alibi_slopes(2))
    assert _compile(masks.causal, alibi).path != _compile(masks.causal, alibi, dtype=torch.float64).path


@pytest.mark.parametrize("mask", [masks.sliding_window(8), masks.chunked_causal(24),
                                  masks.document(torch.tensor([0, 0, 1, 1, 1, 2]), causal=True)],
                         ids=lambda m: m.__name__)
def test_full_tiles_have_no_mask_code(mask):
    source = _compile(mask, scores.alibi(scores.alibi_slopes(2))).source
    # both loops run the one tile function, the FULL loop with MASKED=False
    assert source.count("# PARTIAL tiles") == 1 and source.count("# FULL tiles") == 1
    head, full_loop = source.split("# FULL tiles")
    partial_loop = head.split("# PARTIAL tiles")[1]
    assert partial_loop.count("_fwd_tile(") == 1 and "MASKED=True" in partial_loop
    assert full_loop.count("_fwd_tile(") == 1 and "MASKED=False" in full_loop
    # where MASKED, a compile-time constant, leaves FULL tiles no mask code
    tile = _block(source, "def _fwd_tile(")
    partial, full = _block(tile, "    if MASKED:"), _block(tile, "    else:", after="    if MASKED:")
    mask_text = TritonPrinter().doprint(mask.expr)
    assert f"keep = ({mask_text}) != 0" in partial and source.count(mask_text) == 1
    assert "keep" not in full
    # the score mod is applied on both; FULL tiles use ALiBi's split form (codegen/separable.py)
    assert tile.count("s = (") == 1 and "s = (" not in full
    assert full.count("t = qk * score_scale + (") == 1


def test_the_gluon_dkdv_kernel_splits_a_score_whose_coefficient_is_one():
    # ALiBi (score + row + column): FULL tiles take one FMA a score, PARTIAL ones the mod as written
    alibi = as_score_mod(scores.alibi(scores.alibi_slopes(2))).traced
    source = KernelSource.of("hbwd", as_mask_mod(masks.causal).traced, alibi, exact=False)
    assert source.split_score
    text = render(source).text
    probabilities = _block(text, "def _probabilities(")
    full = _block(probabilities, "    else:", after="    if MASKED:")
    assert "gl.fma(qk, qk_scale * LOG2E, (" in full and "score = " not in full and "s = (" not in full
    assert "s = (score + " in _block(probabilities, "    if MASKED:")
    # not for float64, nor where d(score_mod)/d(score) is not 1, which the FULL tiles would need
    assert not KernelSource.of("hbwd", None, alibi, exact=True).split_score
    halved = as_score_mod(lambda score, b, h, q_idx, kv_idx: score * 0.5 + kv_idx).traced
    assert not KernelSource.of("hbwd", None, halved, exact=False).split_score
    assert KernelSource.of("hfwd", None, halved, exact=False).split_score
    # nor the Triton backward
    assert not KernelSource.of("bwd", None, alibi, exact=False).split_score


def _block(source: str, header: str, after: str | None = None) -> str:
    """The lines of `source` in the block that the line `header` opens (the first such line
    after the line `after`)."""
    lines = source.splitlines()
    first = lines.index(after) if after else 0
    start = lines.index(header, first)
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent and not line.strip().startswith(")"):
            break
        body.append(line)
    return "\n".join(body)


# -- sharing --------------------------------------------------------------------------------
def test_equivalent_spellings_share_one_kernel():
    def ge(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def le(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    first = _compile(ge)
    assert maskc.runtime.cache_info().misses == 1
    for other in (le, masks.causal):
        kernel = _compile(other)
        assert (kernel.signature, kernel.path) == (first.signature, first.path)
    info = maskc.runtime.cache_info()
    assert (info.misses, info.hits, info.currsize) == (1, 2, 1)


def test_window_sizes_share_one_kernel():
    q, k, v = qkv(D=32)
    out8 = _run_and_check(q, k, v, mask_mod=masks.sliding_window(8))
    misses = maskc.runtime.cache_info().misses
    assert misses == 1
    out16 = _run_and_check(q, k, v, mask_mod=masks.sliding_window(16))
    assert maskc.runtime.cache_info().misses == misses
    assert not torch.allclose(out8, out16)
    assert _compile(masks.sliding_window(8)).path == _compile(masks.sliding_window(1000)).path


def test_captured_tensor_values_do_not_compile():
    ids = torch.tensor([0] * 10 + [1] * 20 + [2] * 10)
    mask = masks.document(ids, causal=True)
    q, k, v = qkv(D=32)
    before = _run_and_check(q, k, v, mask_mod=mask)
    misses = maskc.runtime.cache_info().misses
    ids[15:] = 3  # in place: the same mask object now means something else
    after = _run_and_check(q, k, v, mask_mod=mask)
    assert not torch.allclose(before, after)
    other = masks.document(torch.arange(40) // 7, causal=True)  # another tensor, same expression
    _run_and_check(q, k, v, mask_mod=other)
    assert maskc.runtime.cache_info().misses == misses


def test_a_new_expression_renders_and_a_new_dtype_or_head_dim_does_not():
    _compile(masks.causal)
    _compile(masks.causal, dtype=torch.float16)
    _compile(masks.causal, head_dim=64)
    _compile(masks.causal, head_dim_v=16)
    _compile(masks.prefix_lm(4))
    _compile(masks.causal, scores.softcap(3.0))
    info = maskc.runtime.cache_info()
    assert (info.misses, info.hits) == (3, 3)
    assert len(os.listdir(os.environ["MASKC_CACHE_DIR"])) == 3


def test_signature_equal_masks_with_different_captures():
    ids = torch.arange(40) // 5

    def folded(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[q_idx]) & (q_idx >= kv_idx)

    folded = maskc.mask_mod(folded)
    # the capture simplified away, so it is dropped: the signature alone decides the kernel
    assert folded.signature == masks.causal.signature and folded.traced.tensors == ()
    q, k, v = qkv(D=32)
    _run_and_check(q, k, v, mask_mod=masks.causal)
    _run_and_check(q, k, v, mask_mod=folded)



def test_codegen_edits_give_new_cache_entries(tmp_path, monkeypatch):
    # A kernel's text depends on the printer and render code as much as on the templates:
    # editing either within one version must not find the old file on disk.
    render_module = importlib.import_module("maskc.codegen.render")  # the package exports a function of that name
    copy = tmp_path / "codegen"
    shutil.copytree(os.path.dirname(render_module.__file__), copy)
    monkeypatch.setattr(render_module, "__file__", str(copy / "render.py"))
    render_module.codegen_hash.cache_clear()
    try:
        same = render_module.codegen_hash()
        printer = copy / "printer.py"
        printer.write_text(printer.read_text() + "\n# an edit\n")
        render_module.codegen_hash.cache_clear()
        edited = render_module.codegen_hash()
    finally:
        monkeypatch.undo()
        render_module.codegen_hash.cache_clear()
    assert same == render_module.codegen_hash()
    assert edited != same

# -- memory, disk, other processes ----------------------------------------------------------
def test_memory_then_disk(cache_dir):
    kernel = _compile(masks.causal)
    mtime = kernel.path.stat().st_mtime_ns
    assert _compile(masks.causal) is kernel
    assert tuple(maskc.runtime.cache_info()) == (1, 1, 0, 1)
    KERNELS.clear()
    again = _compile(masks.causal)
    assert tuple(maskc.runtime.cache_info()) == (0, 0, 1, 1)
    assert again.source == kernel.source and again.path == kernel.path
    assert kernel.path.stat().st_mtime_ns == mtime  # read, not rewritten
    assert not [p for p in cache_dir.iterdir() if p.suffix != ".py"]  # no temporary files left


_CHILD = """
import json, torch, maskc
maskc.compile(maskc.masks.causal, dtype=torch.float32, head_dim=32, device="cpu")
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.sliding_window(5))
ref, _ = maskc.testing.attention_reference(q, k, v, mask_mod=maskc.masks.sliding_window(5))
maskc.testing.assert_close_to_reference(out, ref)
print(json.dumps(maskc.runtime.cache_info()._asdict()))
"""


def test_second_process_renders_nothing(cache_dir):
    _compile(masks.causal)
    q, k, v = qkv(D=32)
    _run_and_check(q, k, v, mask_mod=masks.sliding_window(9))
    files = sorted(cache_dir.iterdir())
    assert len(files) == 2
    env = {**os.environ, "MASKC_CACHE_DIR": str(cache_dir)}
    env.pop("MASKC_DEBUG", None)
    result = subprocess.run([sys.executable, "-c", "import maskc.testing\n" + _CHILD], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["misses"] == 0 and info["disk_hits"] >= 2, info
    assert sorted(cache_dir.iterdir()) == files


def test_debug_prints_the_source(monkeypatch, capsys):
    monkeypatch.setenv("MASKC_DEBUG", "1")
    kernel = _compile(masks.sliding_window(3))
    out = capsys.readouterr().out
    assert kernel.source in out and str(kernel.path) in out
    KERNELS.clear()
    _compile(masks.sliding_window(3))  # read from disk: printed too
    assert kernel.source in capsys.readouterr().out
    monkeypatch.setenv("MASKC_DEBUG", "0")
    KERNELS.clear()
    _compile(masks.sliding_window(3))
    assert capsys.readouterr().out == ""


# -- Triton's own cache key -----------------------------------------------------------------
@pytest.fixture
def triton_key(monkeypatch):
    """Triton's triton_key(), put back after the test (a compiled load hands Triton another)."""
    computed = triton.runtime.cache.triton_key
    monkeypatch.setattr(triton.runtime.cache, "triton_key", computed)
    return computed


def _stored_key(cache_dir):
    return json.loads((cache_dir / "triton_key.json").read_text())["key"]


def test_compiled_load_keeps_tritons_key(cache_dir, triton_key):
    kernel = _compile(masks.causal)
    loader.load(kernel.path, interpret=False)
    assert _stored_key(cache_dir) == triton_key()  # the value Triton computes, about 0.3 s
    assert triton.runtime.cache.triton_key() == triton_key()


def test_stored_key_is_handed_to_triton_while_triton_is_unchanged(cache_dir, triton_key):
    kernel = _compile(masks.causal)
    (cache_dir / "triton_key.json").write_text(json.dumps({"stamp": loader._triton_stamp(), "key": "stored"}))
    loader.load(kernel.path, interpret=False)
    assert triton.runtime.cache.triton_key() == "stored"
    loader.load(kernel.path, interpret=False)  # handed over once
    assert triton.runtime.cache.triton_key() == "stored"


def test_stored_key_of_another_triton_is_replaced(cache_dir, triton_key):
    kernel = _compile(masks.causal)
    stamp = loader._triton_stamp()
    stamp[1][2] += 1  # a file of Triton changed since the key was stored
    (cache_dir / "triton_key.json").write_text(json.dumps({"stamp": stamp, "key": "stale"}))
    loader.load(kernel.path, interpret=False)
    assert triton.runtime.cache.triton_key() == triton_key() == _stored_key(cache_dir)


def test_interpreted_runs_leave_tritons_key_alone(cache_dir, triton_key):
    q, k, v = qkv(D=32)
    _run_and_check(q, k, v, mask_mod=masks.causal)
    assert triton.runtime.cache.triton_key is triton_key
    assert not (cache_dir / "triton_key.json").exists()


# -- block maps -----------------------------------------------------------------------------
@pytest.fixture
def builds(monkeypatch):
    calls = []
    real = plan.build_block_map

    def counting(mask, *args, **kwargs):
        calls.append(mask.__name__)
        return real(mask, *args, **kwargs)

    monkeypatch.setattr(plan, "build_block_map", counting)
    return calls


def test_block_maps_are_reused(builds):
    q, k, v = qkv(D=32)
    for _ in range(3):
        _run_and_check(q, k, v, mask_mod=masks.sliding_window(8))
    assert len(builds) == 1
    _run_and_check(q, k, v, mask_mod=masks.sliding_window(8))  # an equal mask from a new factory call
    assert len(builds) == 1
    _run_and_check(q, k, v, mask_mod=masks.sliding_window(16))  # other parameter values: another map
    _run_and_check(q[:, :, :33], k, v, mask_mod=masks.sliding_window(16))  # other lengths: another map
    assert len(builds) == 3
    assert len(plan.BLOCK_MAPS) == 3


def test_block_map_follows_in_place_changes(builds):
    ids = torch.tensor([0] * 20 + [1] * 20)
    mask = masks.document(ids)
    q, k, v = qkv(D=32)
    _run_and_check(q, k, v, mask_mod=mask)
    _run_and_check(q, k, v, mask_mod=mask)
    assert len(builds) == 1
    ids[5:25] = 7
    _run_and_check(q, k, v, mask_mod=mask)
    assert len(builds) == 2


def test_given_block_map_builds_nothing(builds):
    q, k, v = qkv(D=32)
    bm = maskc.block_map(masks.causal, 40, 40, block_size=(32, 32))
    _run_and_check(q, k, v, mask_mod=masks.causal, block_map=bm)
    assert builds == []


def test_a_training_step_analyses_its_mask_once(builds):
    # backward tiles unlike the forward's (on CUDA: 64×64 forward, 128×64 dQ, 64×128 dK/dV):
    # they read the forward's map coarsened, not a map analysed again
    q, k, v = qkv(Lq=70, D=32, requires_grad=True)
    with use_config(backward=BackwardConfig(TileConfig(64, 32, 4, 1), TileConfig(32, 64, 4, 1))):
        out = _run_and_check(q, k, v, mask_mod=masks.sliding_window(9))
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert len(builds) == 1
    ref, _ = attention_reference(q.double(), k.double(), v.double(), mask_mod=masks.sliding_window(9))
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))):
        assert_close_to_reference(got, want)


# -- Triton-key shortcut off ------------------------------------------------------------------
def test_triton_key_shortcut_can_be_turned_off(cache_dir, triton_key, monkeypatch):
    monkeypatch.setenv("MASKC_TRITON_KEY", "0")
    kernel = _compile(masks.causal)
    loader.load(kernel.path, interpret=False)
    assert triton.runtime.cache.triton_key is triton_key
    assert not (cache_dir / "triton_key.json").exists()


# -- what runs is the text checked, and nothing else of the directory -------------------------
def _bytecode(path):
    """Where Python's import system keeps and looks for the bytecode of the source `path`."""
    return Path(importlib.util.cache_from_source(str(path)))


def test_a_planted_bytecode_file_is_not_run(cache_dir, fresh_caches, tmp_path):
    kernel = _compile(masks.causal)
    marker, planted = tmp_path / "ran", tmp_path / "planted.py"
    planted.write_text(f"open({str(marker)!r}, 'w').close()\n")
    # an unchecked-hash .pyc: the import system runs it without looking at the source
    py_compile.compile(str(planted), cfile=str(_bytecode(kernel.path)),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    KERNELS.clear()
    q, k, v = qkv(Lq=80, D=32)  # more rows than decoding takes: the forward kernel's file runs
    _run_and_check(q, k, v, mask_mod=masks.causal)
    assert not marker.exists()


def test_a_corrupt_bytecode_file_is_not_read(cache_dir, fresh_caches):
    kernel = _compile(masks.causal)
    stat = kernel.path.stat()
    # a header that matches the source (magic, flags, mtime, size), then no valid marshal data
    header = importlib.util.MAGIC_NUMBER + b"\0" * 4 + struct.pack("<II", int(stat.st_mtime) & 0xFFFFFFFF,
                                                                  stat.st_size & 0xFFFFFFFF)
    _bytecode(kernel.path).parent.mkdir()
    _bytecode(kernel.path).write_bytes(header + b"\xff" * 64)
    KERNELS.clear()
    q, k, v = qkv(Lq=80, D=32)
    _run_and_check(q, k, v, mask_mod=masks.causal)


def test_no_bytecode_is_written(cache_dir, fresh_caches, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as Python runs unless PYTHONDONTWRITEBYTECODE is set
    q, k, v = qkv(Lq=80, D=32)
    _run_and_check(q, k, v, mask_mod=masks.sliding_window(3))
    assert sorted(p.suffix for p in cache_dir.iterdir()) == [".py"]


def test_a_file_that_does_not_name_its_kernel_is_stale_and_rendered_again(cache_dir, fresh_caches, capsys):
    kernel = _compile(masks.causal)
    kernel.path.write_text(cache.stamped(kernel.source.split("\n", 2)[2], provenance()))  # as older versions wrote
    assert main(["cache", "prune", "--dry-run"]) == 0
    assert "stale, written before maskc named the kernel in its files" in capsys.readouterr().out
    KERNELS.clear()
    with pytest.warns(UserWarning, match="does not name the kernel it holds"):
        assert _compile(masks.causal).source == kernel.source
    assert kernel.path.read_text() == kernel.source


@pytest.mark.parametrize("action", [["clear"], ["prune", "--max-size", "1G"]], ids=lambda a: a[0])
def test_cache_commands_delete_a_leftover_bytecode_directory(cache_dir, fresh_caches, action, capsys):
    kernel = _compile(masks.causal)
    _bytecode(kernel.path).parent.mkdir()
    _bytecode(kernel.path).write_bytes(b"left by an older maskc")
    assert main(["cache", *action]) == 0
    assert not _bytecode(kernel.path).parent.exists()
    assert "__pycache__" in capsys.readouterr().out


@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_a_loaded_kernel_needs_its_file_no_more(cache_dir, fresh_caches, change):
    # Triton's interpreter reads a function's source again at its first launch, after another
    # process's eviction may have deleted the file (or another file replaced it): it reads the
    # text this process checked
    kernel = _compile(masks.causal)
    kernel.function(interpret=True)
    if change == "deleted":
        kernel.path.unlink()
    else:  # another kernel's text, which takes the same arguments and keeps every pair
        kernel.path.write_text(_compile(None).source)
    q, k, v = qkv(Lq=80, D=32)
    _run_and_check(q, k, v, mask_mod=masks.causal)


_SHARER = """
import sys, torch, maskc
from maskc import masks
from maskc.inference import decode
from maskc.runtime import KERNELS, plan
seed = int(sys.argv[1])
mods = [masks.causal, masks.sliding_window(4), masks.prefix_lm(8), masks.chunked_causal(16)]
g = torch.Generator().manual_seed(seed)
q, k, v = (torch.randn(1, 1, 70, 16, generator=g) for _ in range(3))
outs = []
for i in range(30):
    for memo in (KERNELS, plan.PLANS, plan.BLOCK_MAPS, decode.DECODES):
        memo.clear()  # read (or render) the file again, load it and launch it for the first time
    outs.append(maskc.compiled_attention(q, k, v, mask_mod=mods[(i + seed) % len(mods)]))
for i, out in enumerate(outs):  # after the loop, which keeps the processes' writes close together
    mask = mods[(i + seed) % len(mods)]
    maskc.testing.assert_close_to_reference(out, maskc.testing.attention_reference(q, k, v, mask_mod=mask)[0])
print("ok")
"""


@pytest.mark.slow
def test_processes_sharing_a_capped_cache(cache_dir):
    # each write evicts every other kernel, so first launches, where Triton's interpreter reads
    # the functions' source again, meet files deleted since their load (about 90 s; the default
    # lane has test_a_loaded_kernel_needs_its_file_no_more)
    env = {**os.environ, "MASKC_CACHE_DIR": str(cache_dir), "MASKC_CACHE_MAX_SIZE": "1"}
    sharers = [subprocess.Popen([sys.executable, "-c", "import maskc.testing\n" + _SHARER, str(seed)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in range(3)]
    for sharer in sharers:
        out, err = sharer.communicate(timeout=600)
        assert (sharer.returncode, out) == (0, "ok\n"), err[-3000:]


# -- settings are checked when read, before anything is written -------------------------------
@pytest.mark.parametrize("stored", [False, True], ids=["missing", "on disk"])
def test_an_invalid_size_cap_is_one_error_whatever_the_cache_holds(cache_dir, fresh_caches, monkeypatch, stored):
    if stored:
        _compile(masks.causal)
        KERNELS.clear()
    before = sorted(cache_dir.iterdir()) if cache_dir.exists() else []
    monkeypatch.setenv("MASKC_CACHE_MAX_SIZE", "1e3")
    for _ in range(2):  # and the same again
        with pytest.raises(maskc.MaskcError, match=r"^MASKC_CACHE_MAX_SIZE must be a size like 500M or 2G .*, "
                                                   r"got '1e3'; fix or unset it$"):
            _compile(masks.causal)
    assert (sorted(cache_dir.iterdir()) if cache_dir.exists() else []) == before


@pytest.mark.parametrize("name,read", [("MASKC_DEBUG", settings.debug), ("MASKC_AUTOTUNE", settings.autotune),
                                       ("MASKC_TRITON_KEY", settings.triton_key_shortcut),
                                       ("MASKC_DIRECT_LAUNCH", settings.direct_launch)],
                         ids=lambda x: getattr(x, "__name__", x))
def test_an_invalid_flag_is_an_error_naming_it(monkeypatch, name, read):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(maskc.MaskcError, match=rf"^{name} must be 1 or 0 .*, got 'maybe'; fix or unset it$"):
        read()
    for value, meaning in (("1", True), ("On", True), ("true", True), ("no", False), ("0", False), ("OFF", False)):
        monkeypatch.setenv(name, value)
        assert read() is meaning


def test_an_invalid_gluon_setting_is_an_error(monkeypatch):
    for value, meaning in (("always", "always"), ("1", "auto"), ("0", "never"), ("off", "never")):
        monkeypatch.setenv("MASKC_GLUON", value)
        assert settings.gluon() == meaning
    monkeypatch.setenv("MASKC_GLUON", "sometimes")
    with pytest.raises(maskc.MaskcError, match=r"^MASKC_GLUON must be 1, 0 or always .*, got 'sometimes'"):
        settings.gluon()
