"""compiled_attention(): validate inputs, find the kernel and block map, launch."""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from maskc._version import __version__
from maskc.analysis.blockmap import BlockMap
from maskc.analysis.build import block_map_of_trace as build_block_map
from maskc.codegen.render import codegen_hash
from maskc.codegen.spec import merge
from maskc.runtime import autotune
from maskc.runtime.configs import TileConfig, bh_group, descriptors_enabled, forward_candidates, override_key, padded
from maskc.runtime.descriptors import DESCRIPTOR_MIN_PAIRS, descriptors
from maskc.runtime.kernel import _DTYPES, CompiledKernel, arch_of, kernel_for
from maskc.trace.mods import as_mask_mod, as_score_mod

_LOG2E = 1.4426950408889634
_SLOTS = 64


class _Slots:
    """A bounded map that drops its least recently used entry first, shared by threads: the
    caches of plans and block maps."""

    def __init__(self, size: int):
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            if len(self._items) > self._size:
                self._items.popitem(last=False)

    def values(self) -> list:
        with self._lock:
            return list(self._items.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


_PLANS = _Slots(_SLOTS)
_BLOCK_MAPS = _Slots(_SLOTS)


@dataclass
class Problem:
    """One attention call after validation: what the kernels need besides q, k, v."""

    mask_mod: object  # MaskMod or None: names the mask, and builds the backward's block maps
    # The traces of the call, read once: the kernel, its parameter values and captured tensors
    # and every block map of the call (the backward's too) come from them, never from a later
    # re-trace of the mods.
    mask: object  # Traced or None
    score: object  # Traced or None
    scale: float
    gqa: bool
    block_map: BlockMap
    given_block_map: bool  # the caller passed block_map=: the backward keeps its tiles
    kernel: CompiledKernel
    extra: list  # captured tensors (pointer, strides, sizes) and parameter values, in kernel order
    launch: "ForwardLaunch | None" = None  # built by the first forward call

    @property
    def interpret(self) -> bool:
        return self.block_map.device.type != "cuda"


def compiled_attention(q, k, v, mask_mod=None, score_mod=None, scale=None, enable_gqa=False, return_lse=False,
                       block_map: BlockMap | None = None):
    """Attention with a specialised, tile-skipping kernel; differentiable in q, k and v.

    q [B, Hq, Lq, D], k [B, Hkv, Lkv, D], v [B, Hkv, Lkv, Dv] (FlexAttention's shapes); k and
    v may have batch 1, shared by every batch of q.
    Returns out [B, Hq, Lq, Dv], or (out, lse) with lse [B, Hq, Lq] in natural log (float32;
    float64 for float64 inputs, which exist for gradcheck and run slowly); both differentiable.
    Rows with no kept key give out = 0 and lse = -inf. CPU tensors run the same generated
    kernel through Triton's interpreter. A captured tensor indexed out of its range reads 0.
    A block_map must come from maskc.block_map() for this mask, its values and captured
    tensors; without mask_mod, the map's own mask runs (as FlexAttention takes a BlockMask's).

    >>> out = maskc.compiled_attention(q, k, v, mask_mod=maskc.masks.sliding_window(1024))
    """
    _check_tensors(q, k, v, enable_gqa)
    mask, score = as_mask_mod(mask_mod), as_score_mod(score_mod)
    if block_map is not None:
        if not isinstance(block_map, BlockMap):
            raise TypeError(f"block_map must be a maskc.BlockMap from maskc.block_map(), got "
                            f"{type(block_map).__name__}")
        if mask is None:
            mask = block_map.mask_mod
    B, Hq, Lq, D = q.shape
    if k.shape[0] != B:
        # views over q's batch: autograd sums their gradients back into k and v
        k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if 0 in (B, Hq, Lq, k.shape[2]):
        from maskc.runtime.backward import NoPairs

        out, lse = NoPairs.apply(q, k, v) if differentiable else no_pairs(q, v)
        return (out, lse) if return_lse else out
    if block_map is not None:
        problem = _given(q, k, v, mask, score, scale, block_map)
    else:
        problem = _planned(q, k, v, mask, score, scale)
    if differentiable:
        from maskc.runtime.backward import AttentionFunction

        out, lse = AttentionFunction.apply(q, k, v, problem)
    else:
        out, lse = forward(q, k, v, problem)
    return (out, lse) if return_lse else out


def no_pairs(q, v):
    """(out, lse) where no (q, kv) pair exists: zeros, and -inf."""
    B, Hq, Lq, _ = q.shape
    out = torch.zeros((B, Hq, Lq, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, Lq), float("-inf"), dtype=accumulator(q.dtype), device=q.device)
    return out, lse


def _traces(mask, score) -> tuple:
    return (mask.traced if mask is not None else None), (score.traced if score is not None else None)


def _check_captured(traces, device):
    for t in (t for t in traces if t is not None):
        for i, tensor in enumerate(t.tensors):
            if tensor.device != device:
                raise ValueError(f"{t.kind} '{t.name}' captured tensor #{i} lives on {tensor.device} but q is on "
                                 f"{device}; move the captured tensor to {device}")
            if tensor.requires_grad and torch.is_grad_enabled():
                raise NotImplementedError(f"{t.kind} '{t.name}' captured tensor #{i} requires grad, but maskc does "
                                          f"not compute gradients of captured tensors yet; detach it, or keep the "
                                          f"learnable bias outside maskc")


def _planned(q, k, v, mask, score, scale) -> Problem:
    """The Problem of a call, remembered by everything it depends on, so that a repeated
    call does no tracing, hashing of expressions or block-map work."""
    traces = _traces(mask, score)
    _check_captured(traces, q.device)
    # Keyed by the traces themselves: a mod re-traced (a global it read changed) gives a new
    # Traced, so a new plan with the new values. A cached plan holds its traces, so their ids
    # are not reused while the key lives.
    key = (*map(id, traces), q.dtype, q.device, q.shape, k.shape, v.shape[3], scale,
           tuple(x._version for t in traces if t is not None for x in t.tensors), override_key())
    problem = _PLANS.get(key)
    if problem is None:
        problem = _problem(q, k, v, mask, score, scale, None, traces=traces)
        _PLANS.put(key, problem)
    return problem


def _given(q, k, v, mask, score, scale, block_map: BlockMap) -> Problem:
    """The Problem of a call given a block map, after checking the map was built for it."""
    traces = _traces(mask, score)
    _check_captured(traces, q.device)
    _check_block_map(block_map, mask, traces[0], q, k)
    return _problem(q, k, v, mask, score, scale, block_map, traces=traces)


def _problem(q, k, v, mask, score, scale, block_map, config: TileConfig | None = None, traces=None) -> Problem:
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    m, s = traces or _traces(mask, score)
    if config is None and block_map is None and autotune.enabled():
        candidates = forward_candidates(D, q.device.type)
        if len(candidates) > 1:
            config = autotune.tuned(_tuning_key(q, k, v, m, s), candidates,
                                    lambda c: _seconds(q, k, v, _problem(q, k, v, mask, score, scale, None, c, (m, s))))
    tiles = block_map.block_size if block_map is not None else None
    kernel = kernel_for("fwd", m, s, q.dtype, D, Dv, Hq != Hkv, tiles, q.device, config)
    spec = kernel.spec
    given = block_map is not None
    if block_map is None:
        block_map = cached_block_map(mask, m, Lq, Lkv, (spec.block_m, spec.block_n), B, Hq, q.device)
    _, _, tensors, params = merge(m, s)
    extra = []
    for t in tensors:
        extra += [t, *t.stride(), *t.shape]
    extra += [p.value for p in params]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return Problem(mask, m, s, scale, Hq != Hkv, block_map, given, kernel, extra)


def _tuning_key(q, k, v, mask, score) -> str:
    """What a tuned choice holds for: the kernel's signature and versions, lengths by bucket."""
    B, Hq, Lq, D = q.shape
    return (f"{mask.signature if mask else ''}|{score.signature if score else ''}|{q.dtype}|d{D}|dv{v.shape[3]}"
            f"|gqa{Hq != k.shape[1]}|{arch_of(q.device)}|lq{autotune.bucket(Lq)}|lkv{autotune.bucket(k.shape[2])}"
            f"|codegen {codegen_hash()}|maskc {__version__}|triton {triton.__version__}")


def _seconds(q, k, v, problem: Problem) -> float:
    """Median wall time of five forwards of `problem`, after one that compiles it."""
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


def interpreter_safe(*tensors):
    """NOTE: Triton's interpreter (3.9) multiplies bf16 tl.dot operands as raw 16-bit
    integers, so on CPU bf16 runs in float32 (exact for bf16 inputs) and is rounded back."""
    if tensors[0].device.type != "cuda" and tensors[0].dtype == torch.bfloat16:
        return tuple(t.float() for t in tensors)
    return tensors


def forward(q, k, v, problem: Problem):
    """(out, lse) from the forward kernel."""
    dtype = q.dtype
    q, k, v = interpreter_safe(q, k, v)
    launch = problem.launch or _forward_launch(q, k, v, problem)
    out = torch.empty(launch.out_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(launch.lse_shape, dtype=launch.lse_dtype, device=q.device)
    tma = None
    if launch.descriptors and descriptors_enabled():
        tma = descriptors(list(zip((q, k, v, out), launch.blocks)))
    launch.fn[launch.grid](
        *(tma or (q, k, v, out)), lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *launch.args,
        TMA=tma is not None, **launch.constexprs)
    return (out if out.dtype == dtype else out.to(dtype)), lse


@dataclass(frozen=True)
class ForwardLaunch:
    """Everything a forward launch takes besides the tensors and their strides. It is fixed
    for a Problem (shapes, dtype, device and block map are), so a cached call builds none of it."""

    fn: object
    grid: tuple
    out_shape: tuple
    lse_shape: tuple
    lse_dtype: torch.dtype
    args: tuple  # sizes, scale, block-map runs, captured tensors and values
    constexprs: dict
    blocks: tuple  # descriptor block shapes of q, k, v, out
    descriptors: bool  # whether descriptors may pay off here (see DESCRIPTOR_MIN_PAIRS)


def _forward_launch(q, k, v, problem: Problem) -> ForwardLaunch:
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    spec, bm = problem.kernel.spec, problem.block_map
    row_b, row_h = bm.kernel_rows(B, Hq)
    even_kv = Lkv % spec.block_n == 0
    d_pad, dv_pad = padded(D), padded(Dv)
    problem.launch = ForwardLaunch(
        fn=problem.kernel.function(problem.interpret),
        grid=(-(-Lq // spec.block_m), B * Hq),
        out_shape=(B, Hq, Lq, Dv),
        lse_shape=(B, Hq, Lq),
        lse_dtype=accumulator(q.dtype),
        args=(Hq, Hq // Hkv, Lq, Lkv, problem.scale if problem.score is not None else problem.scale * _LOG2E,
              bm.full_offsets, bm.full_runs, bm.partial_offsets, bm.partial_runs, row_b, row_h, *problem.extra),
        constexprs=dict(
            HEAD_DIM=D, HEAD_DIM_V=Dv, D_PAD=d_pad, DV_PAD=dv_pad,
            BLOCK_M=spec.block_m, BLOCK_N=spec.block_n, EVEN_KV=even_kv,
            K_UNMASKED=even_kv and D == d_pad, V_UNMASKED=even_kv and Dv == dv_pad,
            POSITIVE_SCALE=problem.scale > 0,
            DOT_PRECISION=dot_precision(q.dtype), ACC=triton_dtype(accumulator(q.dtype)),
            PARTIAL_STAGES=spec.partial_stages, BH_GROUP=bh_group(D),
            num_warps=spec.num_warps, num_stages=spec.num_stages),
        blocks=((1, 1, spec.block_m, d_pad), (1, 1, spec.block_n, d_pad), (1, 1, spec.block_n, dv_pad),
                (1, 1, spec.block_m, dv_pad)),
        descriptors=problem.interpret or B * Hq * Lq * Lkv >= DESCRIPTOR_MIN_PAIRS,
    )
    return problem.launch


def dot_precision(dtype) -> str:
    # float32 inputs get exact products; tf32 would cost about 1e-3 relative error
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def accumulator(dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_dtype(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _check_tensors(q, k, v, enable_gqa):
    # Every call runs this: each attribute is read once (shape and device build new objects).
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, L, D], got shape {tuple(t.shape)}; "
                             f"add the missing batch or head dimension with unsqueeze")
    qs, ks, vs = q.shape, k.shape, v.shape
    qt, kt, vt = q.dtype, k.dtype, v.dtype
    if not (qt == kt == vt):
        raise TypeError(f"q, k and v must share a dtype, got {qt}, {kt}, {vt}; cast them to one")
    if qt not in _DTYPES:
        raise TypeError(f"q, k and v must be float16, bfloat16, float32 or float64, got {qt}; cast them")
    qd, kd, vd = q.device, k.device, v.device
    if not (qd == kd == vd):
        raise ValueError(f"q, k and v must be on one device, got {qd}, {kd}, {vd}; move them")
    if qd.type not in ("cpu", "cuda"):
        raise ValueError(f"maskc runs on CUDA (compiled) or CPU (interpreted), got tensors on {qd}")
    if qt == torch.float64 and qd.type == "cuda":
        # NOTE: Triton 3.6 asserts inside tl.dot on float64 operands on an H100; float64 exists
        # for exact checks, which the interpreter serves
        raise TypeError("float64 attention runs on CPU tensors only (through Triton's interpreter, for "
                        "gradcheck and exact references); on CUDA cast q, k and v to float32")
    if not (ks[0] == vs[0] and ks[0] in (qs[0], 1)):
        raise ValueError(f"batch sizes differ: q {qs[0]}, k {ks[0]}, v {vs[0]}; k and v must have q's batch size, "
                         f"or batch 1 to share one k and v across q's batch")
    if ks[1] != vs[1]:
        raise ValueError(f"k and v must have the same number of heads, got {ks[1]} and {vs[1]}")
    if ks[2] != vs[2]:
        raise ValueError(f"k and v must have the same length, got {ks[2]} and {vs[2]}")
    if qs[3] != ks[3]:
        raise ValueError(f"q and k must have the same head dim, got {qs[3]} and {ks[3]}")
    hq, hkv = qs[1], ks[1]
    if hq != hkv:
        if hkv == 0 or hq % hkv:
            raise ValueError(f"q has {hq} heads, not a multiple of k's {hkv}; grouped-query attention needs "
                             f"Hq % Hkv == 0")
        if not enable_gqa:
            raise ValueError(f"q has {hq} heads and k has {hkv}; pass enable_gqa=True for grouped-query attention")
    for name, d in (("q/k", qs[3]), ("v", vs[3])):
        if not 16 <= d <= 256:
            raise ValueError(f"{name} head dim must be between 16 and 256, got {d}; pad or split the heads")


def _check_block_map(bm: BlockMap, mask, traced, q, k) -> None:
    """Refuse a map built for another mask, other parameter values, other captured tensors or
    other shapes: its FULL and EMPTY tiles would keep or skip pairs this call's mask does not."""
    B, Hq, Lq, _ = q.shape
    Lkv = k.shape[2]
    if bm.traced is None:
        raise ValueError(f"block_map '{bm.mask_name}' records no mask it was built from, so it cannot be checked "
                         f"against this call; build it with maskc.block_map(mask_mod, {Lq}, {Lkv})")
    reason = _built_for_another(bm, mask, traced)
    if reason is not None:
        fix = f"build it with maskc.block_map({mask.__name__}, {Lq}, {Lkv}, block_size={bm.block_size})"
        if mask is not bm.mask_mod:
            fix += " or leave mask_mod out to run the map's own mask"
        raise ValueError(f"block_map {reason}; {fix}")
    if (bm.q_len, bm.kv_len) != (Lq, Lkv):
        raise ValueError(f"block_map was built for q_len={bm.q_len}, kv_len={bm.kv_len} but the inputs have "
                         f"q_len={Lq}, kv_len={Lkv}; build it with maskc.block_map(mask, {Lq}, {Lkv})")
    for size in bm.block_size:
        if size < 16 or size > 256 or size & (size - 1):
            raise ValueError(f"block_map tile sizes must be powers of two from 16 to 256, got {bm.block_size}; "
                             f"build it with block_size=(64, 64) or leave block_map out")
    bm.kernel_rows(B, Hq)
    if bm.device != q.device:
        raise ValueError(f"block_map lives on {bm.device} but q is on {q.device}; move it with "
                         f"block_map.to('{q.device}')")


def _built_for_another(bm: BlockMap, mask, traced) -> str | None:
    """How the call's mask differs from the one `bm` was built from, or None where it does not."""
    built = bm.traced
    theirs, ours = f"mask_mod '{bm.mask_name}'", f"the call's mask_mod '{mask.__name__}'"
    if built.signature != traced.signature:
        return f"was built for {theirs} ({built.expr}) but {ours} is {traced.expr}"
    if [p.value for p in built.params] != [p.value for p in traced.params]:
        return f"was built for {theirs} with {_values(built)} but {ours} has {_values(traced)}"
    for i, (then, now, version) in enumerate(zip(built.tensors, traced.tensors, bm.tensor_versions)):
        if now is not then:
            return f"was built for {theirs} with its captured tensor #{i}, but {ours} captures another tensor there"
        if now._version != version:
            return (f"was built before captured tensor #{i} of {theirs} changed in place (version {version}, now "
                    f"{now._version})")
    return None


def _values(traced) -> str:
    return ", ".join(f"{p.origin}={p.value}" for p in traced.params)


def cached_block_map(mask, traced, Lq, Lkv, block_size, B, Hq, device) -> BlockMap:
    """The block map of `traced`, a trace of the MaskMod `mask` (None: keep every pair)."""
    if mask is None:
        mask = as_mask_mod(_keep_all)
        traced = mask.traced
    # A cached map holds its trace and so its captured tensors: their ids stay theirs while cached.
    key = (traced.signature, tuple(p.value for p in traced.params),
           tuple((id(x), x._version) for x in traced.tensors), Lq, Lkv, block_size, B, Hq, device)
    bm = _BLOCK_MAPS.get(key)
    if bm is None:
        bm = build_block_map(mask, traced, Lq, Lkv, block_size=block_size, B=B, H=Hq, device=device)
        _BLOCK_MAPS.put(key, bm)
    return bm


def _keep_all(b, h, q_idx, kv_idx):
    return q_idx >= 0
