"""Launches: a LaunchPlan binds a kernel's arguments by name, once per Problem; a call fills in
only its tensors and their strides.

The forward kernel, then the backward's three: a preprocess computes Delta = rowsum(dO * O);
dQ runs over the block map, dK/dV over its transpose, summed over the query heads of a GQA
group inside the kernel. On Hopper the forward and dK/dV may be Gluon kernels instead
(maskc/runtime/hopper.py decides). Every kernel reads the one block map of the call at its own tiles
(BlockMap.for_tiles). dQ and the forward load and store through tensor descriptors where the
layout and size allow (maskc/runtime/descriptors.py); the Triton dK/dV kernel keeps pointers,
which measured faster there; the Gluon ones always take descriptors.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import operator
import threading
import time
from contextvars import ContextVar
from itertools import compress

import torch
from triton.runtime import driver
from triton.runtime.errors import OutOfResources

from maskc._log import slow
from maskc.errors import MaskcError
from maskc.runtime import hopper
from maskc.runtime.descriptors import DESCRIPTOR_MIN_PAIRS, descriptors
from maskc.runtime.dropout import Dropout
from maskc.runtime.dtypes import accumulator, dot_precision, interpreter_safe, triton_accumulator
from maskc.runtime.kernel import CompiledKernel
from maskc.runtime.plan import Problem, check_unchanged, kernel_scale
from maskc.runtime.tiles import TileConfig, bh_group, descriptors_enabled, padded
from maskc.settings import direct_launch

_log = logging.getLogger(__name__)
# Launches inside compiling_only() (maskc.warmup) compile their kernels and run nothing: the
# kernels compiled there, by name, with their seconds, in this context. `_warming` counts the
# warmups under way in every thread, so that a launch outside them reads one global.
_compiled: ContextVar[dict | None] = ContextVar("maskc_compiled", default=None)
_warming = 0
_warming_lock = threading.Lock()


class LaunchPlan:
    """One kernel launch with every argument but the per-call ones bound, by name, to the
    kernel's own parameter list (codegen's `Rendered.parameters`). A call passes the values
    of `per_call` in that order; nothing else is positional.

    The direct launch: Triton's `fn[grid](...)` specialises every argument and hashes the
    result into its cache key on each call (most of a tiny problem's 70-80 µs of host time on
    the H100 machine, benchmarks/bench_overhead.py). The kernel that call returns is launched
    directly (`compiled[grid](*args)`, on the current stream) while the per-call values
    specialise as they did then (_Direct): each of the same type, ints that specialise alike (on
    == 1, % 16 and their range: other strides of the same classes launch directly too), tensors
    of the same dtypes still 16-byte aligned, and the same current device. Anything else takes Triton's path, as does MASKC_DIRECT_LAUNCH=0
    (maskc/settings.py). The launcher still calls a profiler's launch hooks."""

    def __init__(self, kernel: CompiledKernel, name: str, interpret: bool, grid: tuple, fixed: dict,
                 per_call: tuple[str, ...], options: dict):
        params = kernel.parameters[name]
        given = set(fixed) | set(per_call)
        missing, unknown = [p for p in params if p not in given], sorted(given - set(params))
        if missing or unknown:
            # codegen and runtime disagree about the kernel's arguments: a maskc bug, named
            raise RuntimeError(f"maskc launch of {name} in {kernel.path}: no value for {missing}, values for "
                               f"parameters it does not have {unknown}")
        self._jit = kernel.function(interpret, name)
        self.fn = self._jit[grid]
        self._what = f"{name} of {kernel.path.name}"
        self._launched = False
        # every argument in the kernel's order, taken in one step from the fixed values followed
        # by a call's (a name in both is the call's)
        kept = tuple(p for p in params if p not in per_call)
        self._fixed = tuple(fixed[p] for p in kept)
        at = {p: i for i, p in enumerate(kept + tuple(per_call))}
        self._arguments = operator.itemgetter(*(at[p] for p in params))
        self._options = {**options, **kernel.options}
        self._grid = grid
        self._direct = None if interpret else False  # None: never; False: not yet; else a _Direct

    def _bound(self, values: tuple) -> tuple:
        """Every argument, the per-call `values` in their places."""
        return self._arguments(self._fixed + values)

    def __call__(self, *values):
        if _warming and _compiled.get() is not None:  # maskc.warmup: compile, launch nothing
            return self.warmup(*values)
        direct = self._direct
        if direct and direct.takes(values):
            return direct.runner(*self._bound(values), stream=driver.active.get_current_stream(direct.device))
        args = self._bound(values)
        compiled = self.fn(*args, **self._options) if self._launched else self._first(args)
        if direct is False and direct_launch():
            self._direct = _Direct.of(compiled, self._grid, values)
        return compiled

    def warmup(self, *values) -> None:
        """Compile the kernel for these per-call values and load it on the GPU without launching
        it, with fewer stages where it does not fit as a first launch would (_fitting): the first
        call then finds it compiled. An interpreted kernel has nothing to compile. Inside
        compiling_only(), the kernel and the seconds it took are recorded there."""
        start = time.perf_counter()
        if self._direct is not None:
            with slow(f"compiling {self._what} (ahead of its first call)"):
                self._fitting(self._bound(values), launch=False)
        compiled = _compiled.get()
        if compiled is not None:
            compiled[self._what] = compiled.get(self._what, 0.0) + time.perf_counter() - start

    def _first(self, args):
        """The first launch, in which Triton compiles the kernel for these constexprs (or finds
        it in its own cache), or the interpreter runs it: timed, logged, and announced on a
        terminal when it runs long."""
        how = "interpreting" if self._direct is None else "compiling"
        start = time.perf_counter()
        with slow(f"{how} {self._what} (the first call of a kernel and shape; later calls reuse it)"):
            compiled = self._fitting(args)
        self._launched = True
        _log.info("first launch of %s (%s) took %.2f s", self._what, how, time.perf_counter() - start)
        return compiled

    def _fitting(self, args, launch: bool = True):
        """Launch (or only compile and load, without `launch`) with fewer pipeline stages while
        the kernel's shared memory does not fit the GPU. The tiles are chosen for q, k and v, but
        a mod's reads of captured tensors in the loop are staged too: attention-gym's Graphormer
        edge bias (two int64 tables read per pair) had its dQ kernel at D=128 ask for 288 KiB of
        an H100's 227
        (tests/gpu/test_compat.py::test_gluon_gym_mods), and the dQ kernel's sums of captured tensors'
        gradients 241 KiB with three stages."""
        while True:
            try:
                if launch:
                    return self.fn(*args, **self._options)
                # NOTE: Triton's warmup compiles without loading the module; _init_handles loads it
                # (Triton 3.6 to 3.9), raising OutOfResources where a launch would
                self._jit.warmup(*args, grid=self._grid, **self._options)._init_handles()
                return None
            except OutOfResources as error:
                # a Gluon kernel's stages are its own constexpr (hopper.failed takes its error)
                if error.name != "shared memory" or "num_stages" not in self._options:
                    raise
                stages = self._options["num_stages"]
                if stages <= 1:
                    raise MaskcError(
                        f"{self._what} needs {error.required} bytes of shared memory with one pipeline stage, "
                        f"more than this GPU's {error.limit}: its tiles were chosen for Hopper's 227 KiB, and a "
                        f"mod's reads of captured tensors are staged there too; store those tensors in a "
                        f"narrower dtype (int32 or int16 indices, float16 values), or on a GPU with less "
                        f"shared memory please report it") from error
                _log.info("%s needs %d bytes of shared memory with %d stages (%d here): trying %d", self._what,
                          error.required, stages, error.limit, stages - 1)
                self._options = {**self._options, "num_stages": stages - 1}


def _int_class(value: int) -> tuple:
    """What Triton specialises an int argument on: equal to 1 (a constant), divisible by 16, and
    its type (i32, i64 or u64 by range)."""
    return value == 1, not value & 15, -2**31 <= value < 2**31, value >= 2**63


_DTYPE = operator.attrgetter("dtype")
_MISALIGNMENT = (15).__and__  # a pointer's offset past 16-byte alignment


class _Direct:
    """A kernel Triton compiled for some per-call values, launched directly (LaunchPlan), with
    what those values specialised as: each one's type (an int stays an int, a tensor a
    tensor), the ints, the tensors' dtypes, every tensor 16-byte aligned, and the current
    device. The checks run in C (map, compress, tuple comparison): a decoding step's launch
    takes 25 values."""

    __slots__ = ("runner", "device", "_types", "_is_int", "_ints", "_int_classes", "_is_tensor", "_dtypes")

    def __init__(self, runner, values: tuple, is_int: tuple, is_tensor: tuple):
        self.runner, self.device = runner, torch.cuda.current_device()
        self._types, self._is_int, self._is_tensor = tuple(map(type, values)), is_int, is_tensor
        self._ints, self._dtypes = tuple(compress(values, is_int)), tuple(map(_DTYPE, compress(values, is_tensor)))
        self._int_classes = tuple(map(_int_class, self._ints))

    @classmethod
    def of(cls, compiled, grid, values: tuple) -> _Direct | None:
        """None where this Triton's compiled kernel has no grid launcher, a value is neither a
        tensor nor an int (a tensor descriptor), or a tensor is not 16-byte aligned."""
        is_int = tuple(type(v) is int for v in values)
        is_tensor = tuple(isinstance(v, torch.Tensor) for v in values)
        if not hasattr(compiled, "__getitem__") or not all(map(operator.or_, is_int, is_tensor)):
            return None
        if any(map(_MISALIGNMENT, map(torch.Tensor.data_ptr, compress(values, is_tensor)))):
            return None
        # the compiled kernel's launcher reads all three grid dimensions
        return cls(compiled[(*grid, 1, 1)[:3]], values, is_int, is_tensor)

    def takes(self, values: tuple) -> bool:
        """Whether `values` specialise as those the kernel was compiled for did."""
        if tuple(map(type, values)) != self._types:
            return False
        ints = tuple(compress(values, self._is_int))
        # the same ints, or others Triton specialises alike: a decoding step over a cache that
        # grows by a token has new strides every step
        if ints != self._ints and tuple(map(_int_class, ints)) != self._int_classes:
            return False
        tensors = tuple(compress(values, self._is_tensor))
        return (not any(map(_MISALIGNMENT, map(torch.Tensor.data_ptr, tensors)))
                and tuple(map(_DTYPE, tensors)) == self._dtypes and torch.cuda.current_device() == self.device)


@contextlib.contextmanager
def compiling_only():
    """A block whose launches, in this thread, compile and load their kernels and run nothing
    (maskc.warmup); yields {kernel: seconds} of the kernels its launches compiled."""
    global _warming
    compiled = {}
    token = _compiled.set(compiled)
    with _warming_lock:
        _warming += 1
    try:
        yield compiled
    finally:
        with _warming_lock:
            _warming -= 1
        _compiled.reset(token)


def _strides(prefix: str, letters: str) -> tuple[str, ...]:
    return tuple(f"stride_{prefix}{c}" for c in letters)


# The per-call parameters of each launch: the tensors (or their descriptors), then their strides.
_FORWARD_CALL = ("Q", "K", "V", "Out", "Lse", *_strides("q", "bhmd"), *_strides("k", "bhnd"), *_strides("v", "bhnd"),
                 *_strides("o", "bhmd"))
_DELTA_CALL = ("Out", "DO", "Delta", *_strides("o", "bhmd"), *_strides("do", "bhmd"))
_DQ_CALL = ("Q", "K", "V", "DO", "DQ", "Lse", "Delta", *_strides("q", "bhmd"), *_strides("k", "bhnd"),
            *_strides("v", "bhnd"), *_strides("do", "bhmd"), *_strides("dq", "bhmd"))
_DKDV_CALL = ("Q", "K", "V", "DO", "DK", "DV", "Lse", "Delta", *_strides("q", "bhmd"), *_strides("k", "bhnd"),
              *_strides("v", "bhnd"), *_strides("do", "bhmd"), *_strides("dk", "bhnd"), *_strides("dv", "bhnd"))
# dropout's, after the others where a call drops (maskc/runtime/dropout.py): the seed and keep_min
_DROPOUT_CALL = ("Rng", "keep_min")


def _map_args(problem: Problem, config: TileConfig, transposed: bool = False) -> dict:
    """The block map's arguments for a kernel with `config`'s tiles (dK/dV: the transpose)."""
    bm, q_multiple, kv_multiple = problem.block_map.for_tiles(config.block_m, config.block_n)
    if transposed:
        bm = bm.transposed
    row_b, row_h = bm.row_strides  # (the call's map was checked for its rows: plan.check_block_map)
    return dict(FULL_OFFSETS=bm.full_offsets, FULL_RUNS=bm.full_runs, PARTIAL_OFFSETS=bm.partial_offsets,
                PARTIAL_RUNS=bm.partial_runs, ROW_STRIDE_B=row_b, ROW_STRIDE_H=row_h,
                SPARSE_Q_MULTIPLE=q_multiple, SPARSE_KV_MULTIPLE=kv_multiple)


def _sizes(problem: Problem) -> dict:
    return dict(num_heads=problem.Hq, group_size=problem.Hq // problem.Hkv, q_len=problem.Lq, kv_len=problem.Lkv,
                HEAD_DIM=problem.D, HEAD_DIM_V=problem.Dv, D_PAD=padded(problem.D), DV_PAD=padded(problem.Dv),
                DOT_PRECISION=dot_precision(problem.dtype), ACC=triton_accumulator(problem.dtype))


def _options(config: TileConfig) -> dict:
    return dict(num_warps=config.num_warps, num_stages=config.num_stages)


def _descriptor_sized(problem: Problem) -> bool:
    """Whether descriptors may pay off here (see DESCRIPTOR_MIN_PAIRS); the interpreter always
    takes them, so CPU tests run that path."""
    return problem.interpret or problem.B * problem.Hq * problem.Lq * problem.Lkv >= DESCRIPTOR_MIN_PAIRS


# -- forward ---------------------------------------------------------------------------------
def outputs(q, dv: int, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (out, lse) of attention over q (the caller's, whose layout the operators' fake
    kernels see too): out [B, Hq, Lq, dv] with its batch, head and row dimensions in the order
    of q's strides, as FlexAttention returns it, so that a model's q made by
    `x.view(B, L, H, D).transpose(1, 2)` gets an out whose `.transpose(1, 2).view(B, L, H * D)`
    works (it failed on a contiguous out). Its last dimension stays innermost, which the copy
    engine needs, whatever q's is; lse [B, Hq, Lq]."""
    dtype = dtype or q.dtype
    B, Hq, Lq, _ = q.shape
    shape = (B, Hq, Lq, dv)
    if q.is_contiguous():  # the common case, on every call's path: no sort, no view
        out = torch.empty(shape, dtype=dtype, device=q.device)
    else:
        order = sorted(range(3), key=lambda d: -q.stride(d)) + [3]  # outermost first; ties keep their order
        out = torch.empty([shape[d] for d in order], dtype=dtype, device=q.device).permute(
            [order.index(d) for d in range(4)])
    return out, torch.empty((B, Hq, Lq), dtype=accumulator(dtype), device=q.device)


def forward(q, k, v, problem: Problem, dropout: Dropout | None = None):
    """(out, lse) from the forward kernel; with `dropout`, the Triton-language kernel's dropping
    variant (the Gluon kernels have none)."""
    dtype = q.dtype
    given = q
    q, k, v = interpreter_safe(q, k, v)
    out, lse = outputs(given, problem.Dv, q.dtype)
    if dropout is None and hopper.runs(problem):
        tma = hopper.descriptors(q, k, v, out, _gluon_forward_tiles(problem)[0])
        if tma is not None and _launch_gluon(problem, "hfwd", _hopper_plan, (*tma, lse)):
            return out, lse
    config = problem.tiles.forward
    tma = None
    if _descriptor_sized(problem) and descriptors_enabled():
        d_pad, dv_pad = padded(problem.D), padded(problem.Dv)
        m, n = config.block_m, config.block_n
        tma = descriptors([(q, (1, 1, m, d_pad)), (k, (1, 1, n, d_pad)), (v, (1, 1, n, dv_pad)),
                           (out, (1, 1, m, dv_pad))])
    dropping = dropout is not None
    launch = problem.launches.get(("fwd", tma is not None, dropping)) or _forward_plan(problem, tma is not None,
                                                                                      dropping)
    launch(*(tma or (q, k, v, out)), lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
           *((dropout.seed, dropout.keep_min) if dropping else ()))
    return (out if out.dtype == dtype else out.to(dtype)), lse


def _dropout_args(dropping: bool) -> tuple[dict, tuple]:
    """A Triton-language kernel's dropout arguments: (fixed values, per-call names)."""
    if dropping:
        return dict(DROPOUT=True), _DROPOUT_CALL
    return dict(DROPOUT=False, Rng=None, keep_min=0), ()


def _forward_plan(problem: Problem, tma: bool, dropping: bool) -> LaunchPlan:
    config = problem.tiles.forward
    even_kv = problem.Lkv % config.block_n == 0
    sizes = _sizes(problem)
    scale = kernel_scale(problem.scale, problem.score is not None)
    fixed = dict(
        **sizes, **_map_args(problem, config), **problem.captured, qk_scale=scale,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, EVEN_KV=even_kv,
        K_UNMASKED=even_kv and sizes["HEAD_DIM"] == sizes["D_PAD"],
        V_UNMASKED=even_kv and sizes["HEAD_DIM_V"] == sizes["DV_PAD"],
        POSITIVE_SCALE=problem.scale > 0, TMA=tma, PARTIAL_STAGES=config.partial_stages,
        BH_GROUP=bh_group(problem.D))
    drop_fixed, drop_call = _dropout_args(dropping)
    grid = (-(-problem.Lq // config.block_m), problem.B * problem.Hq)
    plan = LaunchPlan(problem.forward_kernel, "attention_fwd", problem.interpret, grid, {**fixed, **drop_fixed},
                      _FORWARD_CALL + drop_call, _options(config))
    problem.launches[("fwd", tma, dropping)] = plan
    return plan


def _launch_gluon(problem: Problem, key: str, make_plan, values, prepare=None) -> bool:
    """Launch a Gluon kernel (`key`: "hfwd", "hbwd" or "hbwd+dq", its plan from `make_plan(problem)`) with
    `values`, after `prepare()` where given; False where it failed to compile or on its first
    launch: the Triton-language kernel runs this call, and every later one, since hopper.failed
    records why (maskc/runtime/hopper.py). The problem's first call compiles it before it
    returns, so that every call runs the same kernel; inside compiling_only() it is only compiled,
    and the call that follows launches it first."""
    plan = problem.launches.get(key)
    if plan is not None:
        if prepare is not None:
            prepare()
        plan(*values)
        return True
    try:
        plan = make_plan(problem)
        plan.warmup(*values)
    except Exception as error:  # noqa: BLE001 (rendering, loading its file or compiling: hopper.failed names it)
        hopper.failed(key, error, compiling=True, problem=problem)
        return False
    if _compiled.get() is not None:
        return True
    try:
        if prepare is not None:
            prepare()
        plan(*values)
    except Exception as error:  # noqa: BLE001 (any failure of the first launch: hopper.failed names it)
        hopper.failed(key, error, compiling=False, problem=problem)
        return False
    problem.launches[key] = plan
    return True


def _gluon_forward_tiles(problem: Problem) -> tuple[TileConfig, int, int]:
    return hopper.forward_tiles(problem.D, problem.tiles.sparse[0], scored=problem.score is not None)


def _hopper_plan(problem: Problem) -> LaunchPlan:
    """The Gluon forward's launch (maskc/runtime/hopper.py)."""
    config, registers, consumer_registers = _gluon_forward_tiles(problem)
    kernel = problem.kernel("hfwd")
    scale = kernel_scale(problem.scale, problem.score is not None)
    fixed = dict(
        num_heads=problem.Hq, group_size=problem.Hq // problem.Hkv, q_len=problem.Lq, kv_len=problem.Lkv,
        **_map_args(problem, config), **problem.captured, qk_scale=scale, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, EVEN_KV=problem.Lkv % config.block_n == 0, POSITIVE_SCALE=problem.scale > 0,
        STAGES=config.num_stages, CONSUMER_REGS=consumer_registers, BH_GROUP=bh_group(problem.D))
    grid = (-(-problem.Lq // config.block_m), problem.B * problem.Hq)
    return LaunchPlan(kernel, "attention_fwd_hopper", False, grid, fixed, ("Q", "K", "V", "Out", "Lse"),
                      dict(num_warps=config.num_warps, maxnreg=registers))


def seconds(q, k, v, problem: Problem) -> float:
    """Median wall time of five forwards of `problem`, after one that compiles it (autotuning);
    they run inside compiling_only() too, where autotuning is the planning of maskc.warmup's call."""
    token = _compiled.set(None)
    try:
        return _seconds(q, k, v, problem)
    finally:
        _compiled.reset(token)


def _seconds(q, k, v, problem: Problem) -> float:
    sync = torch.cuda.synchronize if q.device.type == "cuda" else (lambda: None)
    forward(q, k, v, problem)
    sync()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        forward(q, k, v, problem)
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[2]


def no_pairs(q, v):
    """(out, lse) where no (q, kv) pair exists: zeros, and -inf."""
    out, lse = outputs(q, v.shape[3])
    return out.zero_(), lse.fill_(float("-inf"))


# -- backward --------------------------------------------------------------------------------
def backward(q, k, v, out, lse, d_out, d_lse, problem: Problem, *, partial: bool = False,
             dropout: Dropout | None = None):
    """dq, dk, dv and the gradients of problem.grad_tensors, from the gradients of out and of
    lse (either may be None: unused). `partial`: dq, dk and dv in the accumulator's precision
    (float32 for half inputs), unrounded, for a caller that sums them over several launches
    (context parallelism: rounding each part to bf16 loses what the parts cancel). `dropout`:
    the forward's, whose keep-mask the Triton-language kernels regenerate."""
    # every backward comes here (eager autograd, the torch.compile operator, context
    # parallelism), so this is where a captured tensor changed since the forward is refused
    check_unchanged(problem)
    dtype = q.dtype
    d_out = torch.zeros_like(out) if d_out is None else d_out.contiguous()
    # the kernels index lse and Delta as dense [B, Hq, Lq] rows; a caller may pass a view of
    # some rows (context parallelism's query chunks, maskc/distributed/ring.py)
    lse = lse.contiguous()
    q, k, v, out, d_out = interpreter_safe(q, k, v, out, d_out)
    dropping = dropout is not None
    launches = problem.launches.get(("bwd", dropping)) or _backward_plans(problem, dropping)
    drop = (dropout.seed, dropout.keep_min) if dropping else ()
    delta = torch.empty_like(lse)
    launches["delta"](out, d_out, delta, *out.stride(), *d_out.stride())
    if d_lse is not None:
        # dS = P (dP - Delta) + P dlse: the gradient of lse (natural log, as the kernels' P =
        # exp(S - lse)) enters as Delta - dlse. Rows with lse = -inf have P = 0 and get none.
        delta -= d_lse
    grad_dtype = accumulator(dtype) if partial else q.dtype
    dk, dv = (torch.empty_like(t, dtype=grad_dtype) for t in (k, v))
    gluon, dq_sum = (False, None) if dropping else _gluon_backward(problem, q, k, v, d_out, dk, dv, lse, delta)
    if not gluon:
        launches["dkdv"](q, k, v, d_out, dk, dv, lse, delta, *q.stride(), *k.stride(), *v.stride(),
                         *d_out.stride(), *dk.stride(), *dv.stride(), *drop)
    # captured tensors' gradients, summed by the dQ kernel as integers in units of 2**-32
    sums = [torch.zeros(t.shape, dtype=torch.int64, device=q.device) for t in problem.grad_tensors]
    if dq_sum is not None:  # the Gluon kernel summed dQ already: no dQ kernel
        dq = dq_sum.to(grad_dtype)
    else:
        dq = torch.empty_like(q, dtype=grad_dtype)
        tma = None
        # where the forward's launch found descriptors worth their host cost (DESCRIPTOR_MIN_PAIRS).
        # dK/dV measured 5-12% slower with descriptors on an H100 (dQ 5-18% faster), so only dQ
        # takes them (benchmarks/NOTES.md). A float32 dQ keeps pointers: its descriptor's store
        # box would double the shared memory the kernel stages it in.
        if _descriptor_sized(problem) and descriptors_enabled() and dq.dtype == q.dtype:
            m, n = problem.tiles.backward.dq.block_m, problem.tiles.backward.dq.block_n
            d_pad, dv_pad = padded(problem.D), padded(problem.Dv)
            tma = descriptors([(q, (1, 1, m, d_pad)), (k, (1, 1, n, d_pad)), (v, (1, 1, n, dv_pad)),
                               (d_out, (1, 1, m, dv_pad)), (dq, (1, 1, m, d_pad))])
        launches["dq", tma is not None](*(tma or (q, k, v, d_out, dq)), lse, delta, *q.stride(), *k.stride(),
                                        *v.stride(), *d_out.stride(), *dq.stride(),
                                        *(x for g in sums for x in (g, *g.stride())), *drop)
    grads = [(g.double() * 2.0 ** -32).to(t.dtype) for g, t in zip(sums, problem.grad_tensors)]
    if partial:
        return dq, dk, dv, *grads
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), *grads


def _gluon_backward(problem: Problem, q, k, v, d_out, dk, dv, lse, delta):
    """dK and dV from the Gluon kernel where it runs (hopper.runs_backward), and dQ where it
    computes that too (hopper.computes_dq): (whether it ran, dQ in float32 or None)."""
    if not hopper.runs_backward(problem):
        return False, None
    with_dq = hopper.computes_dq(problem)
    # the kernel adds each tile's dQ into the sum: rows no tile reaches stay 0. It is zeroed only
    # where the kernel launches (not where it failed to compile: the dQ kernel runs then)
    dq_sum = torch.empty(q.shape, dtype=torch.float32, device=q.device) if with_dq else None
    tma = hopper.backward_descriptors(q, k, v, d_out, dq_sum, problem.D)
    key = "hbwd+dq" if with_dq else "hbwd"
    if tma is None or not _launch_gluon(problem, key, functools.partial(_hopper_dkdv_plan, with_dq=with_dq),
                                        (*tma, dk, dv, lse, delta, *dk.stride(), *dv.stride()),
                                        dq_sum.zero_ if with_dq else None):
        return False, None
    return True, dq_sum


def _hopper_dkdv_plan(problem: Problem, with_dq: bool) -> LaunchPlan:
    """The Gluon dK/dV kernel's launch (templates/attention_bwd_hopper.py.jinja), computing dQ
    too where `with_dq`."""
    config = hopper.BACKWARD[problem.D]
    kernel = problem.kernel("hbwd")
    fixed = dict(num_heads=problem.Hq, group_size=problem.Hq // problem.Hkv, q_len=problem.Lq, kv_len=problem.Lkv,
                 qk_scale=problem.scale, **_map_args(problem, config, transposed=True), **problem.captured,
                 BLOCK_M=config.block_m, BLOCK_N=config.block_n, EVEN=problem.Lq % config.block_m == 0,
                 EVEN_KV=problem.Lkv % config.block_n == 0, STAGES=config.num_stages, WITH_DQ=with_dq)
    grid = (-(-problem.Lkv // config.block_n), problem.B * problem.Hkv)
    per_call = ("Q", "K", "V", "DO", "DQ", "DK", "DV", "Lse", "Delta", *_strides("dk", "bhnd"), *_strides("dv", "bhnd"))
    return LaunchPlan(kernel, "attention_bwd_dkdv_hopper", False, grid, fixed, per_call,
                      dict(num_warps=config.num_warps, maxnreg=hopper.MAX_REGISTERS))


def _backward_plans(problem: Problem, dropping: bool) -> dict:
    """The backward's four launch plans (dQ with and without descriptors), dropping or not."""
    kernel = problem.backward_kernel()
    config = problem.tiles.backward
    sizes = _sizes(problem)
    interpret = problem.interpret
    drop_fixed, drop_call = _dropout_args(dropping)
    shared = dict(**sizes, **problem.captured, **drop_fixed, qk_scale=problem.scale)
    n_q = -(-problem.Lq // config.dq.block_m)
    plans = {"delta": LaunchPlan(
        kernel, "attention_bwd_delta", interpret, (n_q, problem.B * problem.Hq),
        dict(num_heads=problem.Hq, q_len=problem.Lq, HEAD_DIM_V=problem.Dv, DV_PAD=sizes["DV_PAD"],
             BLOCK_M=config.dq.block_m, ACC=sizes["ACC"]), _DELTA_CALL, {})}
    dq_fixed = dict(**shared, **_map_args(problem, config.dq), BLOCK_M=config.dq.block_m, BLOCK_N=config.dq.block_n,
                    EVEN=problem.Lkv % config.dq.block_n == 0)
    grads = tuple(name for slot, t in zip(problem.grad_slots, problem.grad_tensors)
                  for name in (f"G{slot}", *(f"G{slot}_stride{d}" for d in range(t.dim()))))
    for tma in (False, True):
        plans["dq", tma] = LaunchPlan(kernel, "attention_bwd_dq", interpret, (n_q, problem.B * problem.Hq),
                                      dict(**dq_fixed, TMA=tma), _DQ_CALL + grads + drop_call, _options(config.dq))
    plans["dkdv"] = LaunchPlan(
        kernel, "attention_bwd_dkdv", interpret, (-(-problem.Lkv // config.dkdv.block_n), problem.B * problem.Hkv),
        dict(**shared, **_map_args(problem, config.dkdv, transposed=True), BLOCK_M=config.dkdv.block_m,
             BLOCK_N=config.dkdv.block_n, EVEN=problem.Lq % config.dkdv.block_m == 0),
        _DKDV_CALL + drop_call, _options(config.dkdv))
    problem.launches["bwd", dropping] = plans
    return plans


__all__ = ["LaunchPlan", "backward", "compiling_only", "forward", "no_pairs", "seconds"]
