"""The Gluon kernels for Hopper GPUs: the forward (templates/attention_fwd_hopper.py.jinja) and
dK/dV (attention_bwd_hopper.py.jinja), which computes dQ too where `computes_dq` says so (else
the Triton-language dQ kernel runs; the Delta kernel always does): when they run, their tiles
and their descriptors (their launch plans are maskc/runtime/launch.py's).

They can run where all of these hold, else the Triton-language kernels do (the interpreter
on CPU tensors, other GPUs, other head dims, float32 and float64, a Triton without Gluon):
a CUDA device of compute capability 9.0; Gluon's Hopper module importable; float16 or
bfloat16; q/k and v head dims equal and 64 or 128; at least a copy box of queries (64) and of
keys (128), the smallest extents the GPU check ran; tensors the copy engine can read
(16-byte aligned, last dim contiguous); MASKC_GLUON not 0; and no forward tiles forced
(use_config, which benchmarks/tune.py sweeps for the Triton kernel).

Where it can, it runs only where it measured faster (benchmarks/bench_hopper.py, H100,
B=4 H=16 L=8192, one run; benchmarks/NOTES.md): rows of many kv tiles and no score mod beyond
the split form a·score + row + column. Against the Triton kernel it won on no mask, causal,
prefix-LM and ALiBi (1.12-1.26× at D=128, 1.01-1.09× at D=64) and on sliding windows of 1024
keys and more at D=128 (1.04-1.13×; at D=64 they lost up to 4096 keys); it lost on 12 causal
documents (0.55-0.70×: about 6 tiles a row, and each run pays its pipeline's start), on rows of
fewer tiles than MIN_TILES_PER_ROW (benchmarks/bench_kernel_choice.py) and on softcap
(0.46-0.56×: tanh's arithmetic, on 8 math warps a multiprocessor against the Triton kernel's
12). The dK/dV kernel runs wherever it can, whichever forward ran, and computes dQ as well.
Against the Triton backward at D=128 (H100, bench_attention.py --backward), forward + backward
went from 1.05 to 1.13-1.14× FlexAttention on causal, 1.10 to 1.13-1.15 on prefix-LM and 1.22
to 1.50 on softcap, and from 1.07 to 1.04 on ALiBi, 1.03 to 0.99-1.01 on the sliding window,
1.09 to 1.08 on no mask and 0.98 to 0.97 on documents (benchmarks/NOTES.md); at D=64 it is
1.22-2.04× FlexAttention, from 1.03-1.65× with the Triton backward.
MASKC_GLUON=always runs both wherever they can (the GPU check does).

A problem's kernels are chosen at its first call, which compiles the chosen Gluon kernel before
it returns (launch.py's _launch_gluon: LaunchPlan.warmup, then the launch): every call of the
problem, its first included, runs the same kernel and gives the same bits (but the dQ that the
dK/dV kernel sums with atomic additions, computes_dq). A Gluon compile
that fails or does not fit the GPU is known at that first call, which runs the Triton-language
kernel and records why (`failed`), so that every later call runs it too. The compile is the
first call's cost: 3.0 s for the Gluon forward on the H200 machine against the Triton forward's
0.7 s (benchmarks/compile_latency.py). Gluon's jit compiles through Triton's, so Triton keeps
the binary in its on-disk cache (TRITON_CACHE_DIR) under a key of the kernel functions' source
and line numbers (read from the checked text maskc loads, maskc/runtime/loader.py), their
constexprs, specialisations and options, the GPU and the Triton install; neither the process
nor the module's name enters it, so a new process loads the binary instead of compiling it
(tests/gpu/test_first_call.py). maskc.warmup compiles a call's kernels ahead of the call.
"""
from __future__ import annotations

import functools
import logging
import warnings

import torch
import triton
from triton.runtime.errors import OutOfResources

from maskc.runtime import state, tiles
from maskc.runtime.descriptors import fits
from maskc.settings import gluon as gluon_setting

_log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128)
# 128 query rows a program, two consumer warpgroups of 64; 128-key tiles, three K/V stages (224 KiB
# of shared memory at D=128 with q's two halves, of 227): three beat two by 10-12% at D=128 (no
# mask 3.41 vs 3.81 ms, causal 1.82 vs 2.01) and tied at D=64 (benchmarks/NOTES.md). The
# kernel's 4 warps plus a 4-warp consumer and a producer warp (allocated as 4): 12 warps of 168
# registers fill the register file, and the producer's 24 leave 240 for each consumer thread.
CONFIG = tiles.TileConfig(128, 128, 4, 3)
# a consumer warpgroup's query rows (wgmma's 64), the copy box of Q and Out in the forward
CONSUMER_ROWS = 64
MAX_REGISTERS = 168
CONSUMER_REGISTERS = 240
# At D=64 without a score mod: three consumer warpgroups (192 query rows), FlashAttention 3's
# layout at hdim 64, a third softmax to fill the exp2 and tensor pipes' gaps. 16 warps of 128
# registers fill the register file; the consumers get 160 each. On an H200 (benchmarks/NOTES.md)
# the forward went 2.40 -> 2.10 ms on no mask, 1.31 -> 1.28 causal, 1.37 -> 1.30 prefix-LM, but
# ALiBi's score terms made ptxas spill (296 bytes against no mask's 96) and it lost, 1.54 ->
# 1.91: score mods keep CONFIG, as does a caller's block map whose q tile does not divide 192.
CONFIG_D64 = tiles.TileConfig(192, 128, 4, 3)
MAX_REGISTERS_D64 = 128
CONSUMER_REGISTERS_D64 = 160
# The dK/dV kernel (templates/attention_bwd_hopper.py.jinja): block_m the q tile it loops over
# (wgmma's 64 rows, which dQ's product needs), block_n its 128 kv rows (two consumer warpgroups
# of 64), two Q/dO stages. Its consumers' 240 registers hold dK and dV (128) and a tile's S and
# dP; at D=128 ptxas (Triton 3.6) still spills up to 112 bytes, which no longer shows among the
# stall profile's waits (NOTES).
BACKWARD = {64: tiles.TileConfig(64, 128, 4, 2), 128: tiles.TileConfig(64, 128, 4, 2)}
# The fewest kv tiles (of CONFIG's 128 keys) a q row keeps on average for the Gluon forward to be
# chosen, by head dim: (rows of about one length, rows whose lengths vary: spread std ÷ mean above
# VARIED_ROWS). benchmarks/bench_kernel_choice.py, H200, B=4 H=16, forward, Triton ÷ Gluon:
#   D=128, sliding windows at 8192 keys (spread 0.2-0.3): a tie from 5.8 to 7.6 tiles a row, won
#     from 8.4 (1.04-1.13); causal (spread 0.58) lost at 8.5 (0.93, 2048 keys), won at 16.5 and
#     32.5 (1.14, 1.15); causal documents lost at 8.5-10.9 (0.86-0.95), won at 13.8 and 17.1.
#   D=64: sliding windows lost up to 24.8 (0.83), causal at 16.5 (0.82), tied at 32.5 (1.01).
MIN_TILES_PER_ROW = {128: (8, 12), 64: (32, 32)}
VARIED_ROWS = 0.4
# At D=64 a mask that reads captured tensors needs more: one causal document (causal's rows, with
# the ids' loads in every PARTIAL tile) lost at 32.5 tiles a row (0.95) where causal tied.
TENSOR_MASK_TILES = {128: 1.0, 64: 1.5}
# Why a Gluon kernel ("hfwd", "hbwd", "hbwd+dq") failed in this process, by kind: that kind is not
# tried again. A kernel that did not fit is recorded by what decides its size instead (`failed`):
# in this module, not on its problem, so that a problem evicted from the plan cache and planned
# again does not compile it again. A misfit dropped from its bound is compiled (and fails) again.
_failures: dict[str, str] = {}
state.register(__name__, "_failures", "why each kind of Gluon kernel failed in this process",
               "one entry per kind (hfwd, hbwd, hbwd+dq)", size=lambda: len(_failures), clear=lambda: _failures.clear(),
               maxsize=3)
_misfits = state.lru(__name__, "_misfits", "the mods, head dims and dtypes whose Gluon kernel did not fit the GPU", 256)


def available() -> bool:
    """Whether this Triton has Gluon's Hopper module, which the Gluon kernels need."""
    return _gluon() is not None


@functools.cache
def _gluon():
    """Gluon's host-side descriptor, its shared layout and its dtypes, or None where this Triton has
    no Gluon Hopper module."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401 (the kernel imports it)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor, gl.NVMMASharedLayout, {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
                                                    torch.float32: gl.float32}


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def _can_run(problem) -> bool:
    """Whether the Gluon kernels can run `problem` (the rules in this module's docstring, but the
    tensors' own layout, which the descriptors check per call, and the forward's tiles)."""
    # the problem's own facts first: the interpreter's calls and other shapes read no setting
    return not (problem.interpret or problem.dtype not in (torch.float16, torch.bfloat16) or problem.D != problem.Dv
                or problem.D not in HEAD_DIMS or problem.Lq < CONSUMER_ROWS or problem.Lkv < CONFIG.block_n
                or not _is_hopper(problem.device) or _gluon() is None or not _reads_map(problem))


def _reads_map(problem) -> bool:
    """Whether the Gluon kernels' fixed tiles read the call's block map exactly: a hand-made map
    finer than them whose listed tiles disagree with its mask_mod (BlockMap.coarsens_exactly)
    runs on the Triton-language kernels, whose tiles runtime.tiles.choose fits to it."""
    if not problem.block_map.listed:
        return True
    config = forward_tiles(problem.D, problem.tiles.sparse[0], scored=problem.score is not None)[0]
    return all(problem.block_map.coarsens_exactly(c.block_m, c.block_n) for c in (config, BACKWARD[problem.D]))


def runs(problem) -> bool:
    """Whether the Gluon forward runs `problem`."""
    if tiles.forward_forced() or _failed(problem, "hfwd") or not _can_run(problem):
        return False
    setting = gluon_setting()
    if setting == "never":
        return False
    if setting == "always":
        return True
    faster = problem.launches.get("gluon faster")  # decided once per problem: a host sync
    if faster is None:
        faster = problem.launches["gluon faster"] = _faster(problem)
        _log.debug("forward of B=%d Hq=%d Lq=%d Lkv=%d D=%d %s: the %s kernel (%s)", problem.B, problem.Hq,
                   problem.Lq, problem.Lkv, problem.D, str(problem.dtype).removeprefix("torch."),
                   "Gluon" if faster else "Triton-language",
                   "its rows keep enough kv tiles, where it measured faster" if faster else
                   "a score mod it cannot split, or rows of too few kv tiles, where it measured slower")
    return faster


def runs_backward(problem) -> bool:
    """Whether the Gluon dK/dV kernel runs `problem`'s backward: where the Gluon forward can
    (the forward's shapes cover the dK/dV kernel's tiles), MASKC_GLUON is not 0 and no backward
    tiles are forced."""
    return (not tiles.backward_forced() and not _failed(problem, "hbwd") and _can_run(problem)
            and gluon_setting() != "never")


def computes_dq(problem) -> bool:
    """Whether the Gluon dK/dV kernel computes dQ too, adding each tile's share into a float32
    accumulator with the copy engine's reduction (FlashAttention 3's backward: five matrix
    products a tile instead of the seven of separate dQ and dK/dV kernels). The additions'
    order varies from run to run, so torch.use_deterministic_algorithms(True) keeps the dQ
    kernel; so do captured tensors that need gradients, which the dQ kernel sums. Key lengths
    off its 128-row tiles are fine: past kv_len the kernel sets dS to zero before dQ's product
    (an unmasked P there, overflowing in float16, times K's zero rows was NaN: the GPU check)."""
    return (not problem.grad_tensors and not torch.are_deterministic_algorithms_enabled()
            and not _failed(problem, "hbwd+dq"))


def forward_tiles(head_dim: int, map_q_tile: int, scored: bool) -> tuple[tiles.TileConfig, int, int]:
    """The Gluon forward's tiles, a thread's registers at launch and each worker consumer's:
    three consumers at D=64 without a score mod (`scored`) where the block map's q tile divides
    their 192 rows (BlockMap.for_tiles), else two."""
    if head_dim == 64 and not scored and CONFIG_D64.block_m % map_q_tile == 0:
        return CONFIG_D64, MAX_REGISTERS_D64, CONSUMER_REGISTERS_D64
    return CONFIG, MAX_REGISTERS, CONSUMER_REGISTERS


def _faster(problem) -> bool:
    if problem.score is not None and not problem.forward_kernel.kernel_source.split_score:
        return False
    bm, _, kv_multiple = problem.block_map.for_tiles(CONFIG.block_m, CONFIG.block_n)
    # a map tile of several kernel q tiles stands for as many rows, each as long
    kept = bm.kept_per_row().double() * kv_multiple
    mean = kept.mean()
    even, varied = MIN_TILES_PER_ROW[problem.D]
    fewest = (varied if kept.std(correction=0) > VARIED_ROWS * mean else even) \
        * (TENSOR_MASK_TILES[problem.D] if problem.mask and problem.mask.tensors else 1)
    return bool(mean >= fewest)


_KINDS = {"hfwd": "forward", "hbwd": "dK/dV kernel", "hbwd+dq": "dK/dV kernel with dQ"}


def failed(key: str, error: BaseException, compiling: bool, problem) -> None:
    """The Gluon kernel `key` ("hfwd", "hbwd" or "hbwd+dq") failed to compile or on its first
    launch, and a warning says so. Where it did not fit the GPU (OutOfResources: shared memory,
    which a mod's code adds to), the Triton-language kernel runs this mask and score mod's code
    at this head dim and dtype in its place from now on, and other mods keep the Gluon kernel.
    Any other failure (a Triton whose Gluon differs from the 3.6 and 3.9 the templates were
    compiled with) ends that kind for the process."""
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
    when = "to compile" if compiling else "on its first launch"
    if isinstance(error, OutOfResources):
        _misfits.put(_size_key(problem, key), reason)
        warnings.warn(f"maskc's Gluon {_KINDS[key]} for Hopper did not fit this GPU {when} for this mask and "
                      f"score mod at head dim {problem.D}, {problem.dtype} ({reason}); the Triton-language kernel "
                      f"runs them instead, and other mods keep the Gluon kernel", RuntimeWarning, stacklevel=4)
        return
    _failures[key] = reason
    warnings.warn(f"maskc's Gluon {_KINDS[key]} for Hopper failed {when} with Triton {triton.__version__} "
                  f"({reason}); maskc runs its Triton-language kernel instead from now on. Set MASKC_GLUON=0 "
                  f"to skip the attempt, and please report the error", RuntimeWarning, stacklevel=4)


def _failed(problem, key: str) -> bool:
    """Whether the Gluon kernel `key` failed in this process, or did not fit for this problem's
    mods, head dim and dtype (`failed`)."""
    # (every call asks: the key is built only once something did not fit)
    return key in _failures or (len(_misfits) > 0 and _misfits.get(_size_key(problem, key)) is not None)


def _size_key(problem, key: str) -> tuple:
    # What a Gluon kernel's shared memory and registers depend on: the mods' code (the text of
    # the problem's Triton forward is printed from it; its file's name can change when the file
    # is written again), the head dims and the dtype; not the lengths.
    return key, problem.forward_kernel.source, problem.D, problem.Dv, problem.dtype


def descriptors(q, k, v, out, config: tiles.TileConfig):
    """Gluon tensor descriptors of q, k, v and out over [B, H, L, D] for the forward with
    `config`'s tiles (forward_tiles), or None where one cannot have one (the copy engine's
    alignment rules)."""
    rows = (CONSUMER_ROWS, config.block_n, config.block_n, CONSUMER_ROWS)
    return _descriptors((q, k, v, out), [[1, 1, n, t.shape[3]] for n, t in zip(rows, (q, k, v, out))])


def backward_descriptors(q, k, v, d_out, dq, head_dim: int):
    """Gluon tensor descriptors of q, k, v, dO and (where not None) dQ's float32 sum for the
    dK/dV kernel, or None."""
    config = BACKWARD[head_dim]
    blocks = [[1, 1, n, head_dim] for n in (config.block_m, config.block_n // 2, config.block_n // 2, config.block_m)]
    found = _descriptors((q, k, v, d_out), blocks)
    if found is None:
        return None
    if dq is None:
        return found + [None]
    sums = _descriptors((dq,), [[1, 1, config.block_m, head_dim]])
    return found + sums if sums is not None else None


def _descriptors(tensors, blocks):
    TensorDescriptor, Layout, dtypes = _gluon()
    found = []
    for t, block in zip(tensors, blocks):
        if not fits(t):
            return None
        found.append(TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                      Layout.get_default_for(block, dtypes[t.dtype])))
    return found


__all__ = ["BACKWARD", "CONFIG", "CONFIG_D64", "CONSUMER_REGISTERS", "CONSUMER_REGISTERS_D64", "CONSUMER_ROWS",
           "HEAD_DIMS", "MAX_REGISTERS", "MAX_REGISTERS_D64", "MIN_TILES_PER_ROW", "TENSOR_MASK_TILES",
           "VARIED_ROWS", "backward_descriptors", "computes_dq", "descriptors", "failed", "forward_tiles", "runs",
           "runs_backward"]
