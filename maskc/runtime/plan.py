"""The plan of a call: inputs validated, tiles chosen, kernels found and one block map built.

A Problem is remembered by everything it depends on, so a repeated call does no tracing,
hashing of expressions, block-map work or kernel lookup. Launching it is maskc/runtime/launch.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton

from maskc._version import __version__
from maskc.analysis.blockmap import BlockMap
from maskc.analysis.build import block_map_of_trace as build_block_map
from maskc.analysis.build import serves_any_device
from maskc.analysis.intervals import indices_nonnegative
from maskc.codegen.printer import tensor_args
from maskc.codegen.render import LOG2E, codegen_hash
from maskc.codegen.source import merge
from maskc.runtime import autotune, capture, state, tiles
from maskc.runtime.dtypes import DTYPES
from maskc.runtime.kernel import CompiledKernel, kernel_for
from maskc.settings import autotune as autotune_enabled
from maskc.settings import plan_cache_max_size
from maskc.trace import symbols as S
from maskc.trace.mods import as_mask_mod, captured_needing_grad

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
_SLOTS = 64


def held_bytes(tensors=(), storages=(), maps=()) -> dict:
    """What a cache entry keeps alive, for Slots' bound: {identity: bytes} of the distinct
    storages of `tensors` and `storages` and of the block maps' tables."""
    held = {}
    for storage in (*storages, *(t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor))):
        held[storage.device, storage.data_ptr()] = storage.nbytes()
    for bm in maps:
        held[id(bm)] = bm.nbytes()
    return held


def _problem_bytes(problem: "Problem") -> dict:
    return held_bytes(problem.captured.values(), problem.held, (problem.block_map,))


def _map_bytes(bm: BlockMap) -> dict:
    return held_bytes(storages=bm.traced.storages(), maps=(bm,))


# The two caches of the runtime's plans (the kernels' is maskc/runtime/cache.py's KERNELS),
# bounded by the bytes they keep alive as well as by count: each entry holds its captured
# tensors, and a loop that captures a new dense mask per step would keep the last 64.
PLANS = state.lru(__name__, "PLANS", "the plan of each call signature (a Problem: tiles, kernels, block map, "
                  "captured tensors)", _SLOTS, _problem_bytes, plan_cache_max_size)
BLOCK_MAPS = state.lru(__name__, "BLOCK_MAPS", "the block map of each mask, lengths and tiles", _SLOTS, _map_bytes,
                       plan_cache_max_size)


@dataclass(eq=False)
class Problem:
    """One attention call after validation: what the kernels need besides q, k and v."""

    mask_mod: object  # MaskMod or None: names the mask
    # The traces of the call, read once: the kernels, their captured values and the block map
    # come from them, never from a later re-trace of the mods.
    mask: object  # Traced or None
    score: object  # Traced or None
    scale: float
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lkv: int
    D: int
    Dv: int
    dtype: torch.dtype
    tiles: tiles.Tiles
    block_map: BlockMap  # the one map of the call, at tiles.sparse
    forward_kernel: CompiledKernel
    captured: dict  # kernel argument name -> captured tensor, its strides and sizes, or parameter value
    grad_slots: tuple[int, ...]  # captured tensors whose gradients the backward computes
    grad_tensors: tuple  # those tensors
    negative_indices: bool  # whether a captured-tensor index can be negative in this call (kernel_for)
    # the captured tensors' Traced.stamps() when planned, mask's then score's, and their storages,
    # held so that the pointers stay theirs: the backward refuses tensors changed since (check_unchanged)
    stamps: tuple
    held: tuple
    # LaunchPlans by kernel and variant, built on first use; "gluon faster", runtime/hopper.py's choice
    launches: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.block_map.device

    @property
    def interpret(self) -> bool:
        return self.block_map.device.type != "cuda"

    @property
    def gqa(self) -> bool:
        return self.Hq != self.Hkv

    def backward_kernel(self) -> CompiledKernel:
        return self.kernel("bwd", grad_slots=self.grad_slots)

    def kernel(self, kind: str, grad_slots: tuple[int, ...] = ()) -> CompiledKernel:
        """The `kind` kernel of this call's mods."""
        return kernel_for(kind, self.mask, self.score, self.dtype, self.device, grad_slots=grad_slots,
                          negative_indices=self.negative_indices)


def planned(q, k, v, mask, score, scale, time_forward) -> Problem:
    """The Problem of a call without a block map, remembered by everything it depends on.
    `time_forward(q, k, v, problem)` times a candidate where autotuning is on."""
    traces = traces_of(mask, score)
    grads = check_captured(traces, q.device)
    # Keyed by the traces themselves: a mod re-traced (a global it read changed) gives a new
    # Traced, so a new plan with the new values. A cached plan holds its traces, so their ids
    # are not reused while the key lives.
    key = (*map(id, traces), q.dtype, q.device, q.shape, k.shape, v.shape[3], scale, stamps_of(traces), grads,
           tiles.override_key())
    problem = PLANS.get(key)
    if problem is None:
        capture.refuse_capture(q.device)
        forward = None
        if autotune_enabled():
            candidates = tiles.forward_candidates(q.shape[3], q.device.type)
            if len(candidates) > 1:
                forward = autotune.tuned(
                    _tuning_key(q, k, v, *traces), candidates,
                    lambda c: time_forward(q, k, v, problem_of(q, k, v, mask, score, scale, traces, forward=c)))
        problem = problem_of(q, k, v, mask, score, scale, traces, forward=forward, grad_slots=grads)
        PLANS.put(key, problem)
    return problem


def given(q, k, v, mask, score, scale, block_map: BlockMap) -> Problem:
    """The Problem of a call given a block map, after checking the map was built for it."""
    traces = traces_of(mask, score)
    grads = check_captured(traces, q.device)
    check_block_map(block_map, mask, traces[0], q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
    return problem_of(q, k, v, mask, score, scale, traces, block_map=block_map, grad_slots=grads)


def problem_of(q, k, v, mask, score, scale, traces, *, block_map: BlockMap | None = None,
               forward: tiles.TileConfig | None = None, grad_slots: tuple[int, ...] = ()) -> Problem:
    B, Hq, Lq, D = q.shape
    Hkv, Lkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    m, s = traces
    # (a mod's captured tensors can need more shared memory than the tiles were chosen for: the
    # launch retries with fewer stages, runtime/launch.py's LaunchPlan._fitting)
    chosen = tiles.choose(D, q.device.type, q.element_size(), forward=forward,
                          block_map_size=block_map.block_size if block_map is not None else None,
                          reads_exactly=block_map.coarsens_exactly if block_map is not None else None)
    mask_expr, score_expr, tensors, params = merge(m, s)
    negative = not indices_nonnegative((mask_expr, score_expr), tensors, {p.symbol: p.value for p in params},
                                       {S.B: B, S.H: Hq, S.Q_IDX: Lq, S.KV_IDX: Lkv})
    kernel = kernel_for("fwd", m, s, q.dtype, q.device, negative_indices=negative)
    if block_map is None:
        block_map = cached_block_map(mask, m, Lq, Lkv, chosen.sparse, B, Hq, q.device)
    captured, tensors = captured_args(m, s, q.dtype, q.device, merged=(tensors, params))
    scale = softmax_scale(scale, D)
    return Problem(mask, m, s, scale, B, Hq, Hkv, Lq, Lkv, D, Dv, q.dtype, chosen, block_map, kernel, captured,
                   grad_slots, tuple(tensors[i] for i in grad_slots), negative, stamps_of(traces),
                   tuple(x for t in traces if t is not None for x in t.storages()))


def softmax_scale(scale, head_dim: int) -> float:
    """The scale of q·k: the caller's, or 1/sqrt(head_dim), SDPA's and FlexAttention's default."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def kernel_scale(scale: float, scored: bool) -> float:
    """The scale a kernel multiplies q·k by. Its softmax runs in base 2: without a score_mod
    log2(e) folds in here; a score_mod sees natural units, and the kernel multiplies its
    result by log2(e) itself (templates/_softmax.py.jinja's LOG2E, codegen/render.py's LOG2E)."""
    return scale if scored else scale * LOG2E


def captured_args(mask, score, dtype: torch.dtype, device: torch.device,
                  merged: tuple | None = None) -> tuple[dict, tuple]:
    """The kernels' arguments for the traces' captured tensors (each with its strides and sizes)
    and parameters, by name, and the tensors in codegen's numbering. `dtype` and `device`: the
    inputs' (a CPU scalar is read from a copy on `device`, made when the call is planned: a
    plan is keyed by its tensors' versions, so a scalar changed in place is copied again). A
    float64 tensor of the score mod beside narrower inputs is read from a float32 copy, the
    kernels' arithmetic: a float64 score would meet the float32 accumulators (Triton refuses
    the mix) for a difference of one float32 rounding. The mask's are read as they are, as the
    block map read them. `merged`: merge(mask, score)'s tensors and parameters, where the caller
    has them (a call with a block map builds its Problem every time)."""
    tensors, params = merged or merge(mask, score)[2:]
    first_score_slot = len(mask.tensors) if mask is not None else 0
    args = {}
    for slot, t in enumerate(tensors):
        narrowed = slot >= first_score_slot and t.dtype == torch.float64 and dtype != torch.float64
        read = t.detach().to(torch.float32) if narrowed else t
        if serves_any_device(read) and device.type != "cpu":
            read = read.to(device)
        args.update(zip(tensor_args(slot, t.dim()), (read, *read.stride(), *read.shape)))
    args.update((f"p{i}", p.value) for i, p in enumerate(params))
    return args, tensors


def mask_of_call(mask, block_map):
    """The mask a call runs: `mask`, or the map's own where the call gives none (as FlexAttention
    takes a BlockMask's), after checking `block_map` is a BlockMap."""
    if block_map is None:
        return mask
    if not isinstance(block_map, BlockMap):
        raise TypeError(f"block_map must be a maskc.BlockMap from maskc.block_map() or a torch BlockMask from "
                        f"create_block_mask, got {type(block_map).__name__}")
    return block_map.mask_mod if mask is None else mask


def traces_of(mask, score) -> tuple:
    return (mask.traced if mask is not None else None), (score.traced if score is not None else None)


def stamps_of(traces) -> tuple:
    """The stamps (Traced.stamps) of the captured tensors of `traces` (mask, score), in order."""
    return tuple(stamp for t in traces if t is not None for stamp in t.stamps())


def check_unchanged(problem: Problem) -> None:
    """Refuse a backward whose captured tensors changed since its forward (`problem`'s stamps):
    it would read their new values against the forward's outputs and block map, as autograd
    refuses a saved tensor modified in place (FlexAttention saves the mods' buffers)."""
    traces = (problem.mask, problem.score)
    if stamps_of(traces) == problem.stamps:
        return
    then = iter(problem.stamps)
    for t in (t for t in traces if t is not None):
        for i, (x, before) in enumerate(zip(t.tensors, then)):
            now = (x._version, x.data_ptr())
            if now == before:
                continue
            how = (f"is at version {now[0]}, and was at {before[0]} in the forward" if now[0] != before[0] else
                   "has had new storage since the forward (.data was assigned)")
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: {t.kind} '{t.name}' captured tensor #{i} "
                               f"({str(x.dtype).removeprefix('torch.')} {list(x.shape)}) {how}, so maskc's "
                               f"backward would read other values than its forward did; clone it before changing "
                               f"it, or change it after backward()")


def _tuning_key(q, k, v, mask, score) -> str:
    """What a tuned choice holds for: the kernel's signature and versions, lengths by bucket."""
    B, Hq, Lq, D = q.shape
    arch = "sm{}{}".format(*torch.cuda.get_device_capability(q.device)) if q.device.type == "cuda" else "interpreter"
    return (f"{mask.signature if mask else ''}|{score.signature if score else ''}|{q.dtype}|d{D}|dv{v.shape[3]}"
            f"|gqa{Hq != k.shape[1]}|{arch}|lq{autotune.bucket(Lq)}|lkv{autotune.bucket(k.shape[2])}"
            f"|codegen {codegen_hash()}|maskc {__version__}|triton {triton.__version__}")


def cached_block_map(mask, traced, Lq, Lkv, block_size, B, Hq, device, settle: bool = True) -> BlockMap:
    """The block map of `traced`, a trace of the MaskMod `mask` (None: keep every pair);
    `settle` as build_block_map's."""
    if mask is None:
        mask = as_mask_mod(_keep_all)
        traced = mask.traced
    # A cached map holds its trace and so its captured tensors: their ids stay theirs while cached.
    key = (traced.signature, tuple(p.value for p in traced.params), tuple(map(id, traced.tensors)), traced.stamps(),
           Lq, Lkv, block_size, B, Hq, device, settle)
    bm = BLOCK_MAPS.get(key)
    if bm is None:
        capture.refuse_capture(device)
        bm = build_block_map(mask, traced, Lq, Lkv, block_size=block_size, B=B, H=Hq, device=device, settle=settle)
        BLOCK_MAPS.put(key, bm)
    return bm


def _keep_all(b, h, q_idx, kv_idx):
    return q_idx >= 0


# -- validation ------------------------------------------------------------------------------
def check_tensors(q, k, v, enable_gqa):
    """Refuse q, k and v that no kernel can take, with the errors every entry point shares.

    Runs once per call, where the call's inputs first meet maskc: compiled_attention's eager
    path (runtime/api.py: decode.contiguous and the plans take them checked), paged_attention's
    decode.paged (against empty stand-ins for the cache's keys; under torch.compile too, in its
    operator), maskc.distributed.attention, and the fake kernels of the maskc::attention and
    maskc::decode operators (runtime/ops.py), which run when the graph is traced, so that a
    compiled call fails there as the eager call does; those operators' implementations take
    their inputs checked. tests/test_one_owner.py counts the calls."""
    # each attribute is read once (shape and device build new objects): every call runs this
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise TypeError(f"{name} is a nested (jagged) tensor, which maskc does not take; pad the sequences to "
                            f"one length (padded keys masked out) or pack them into one with a document mask "
                            f"(maskc.masks.document)")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, H, L, D], got shape {tuple(t.shape)}; "
                             f"add the missing batch or head dimension with unsqueeze")
    qs, ks, vs = q.shape, k.shape, v.shape
    qt, kt, vt = q.dtype, k.dtype, v.dtype
    if not (qt == kt == vt):
        raise TypeError(f"q, k and v must share a dtype, got {qt}, {kt}, {vt}; cast them to one")
    if qt not in DTYPES:
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
    check_head_dims(qs[3], vs[3])


# The dtypes an integer tensor argument (kv_lens, seq_ids, a page table) may have: torch's
# unsigned types past uint8 lack the arithmetic that narrowing needs, and bool is a mask.
INDEX_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def index_argument(name: str, t, *, what: str, fix: str, device, owner: str, dims: int = 1,
                   batch: int | None = None, within: tuple[int, int] | None = None) -> torch.Tensor:
    """The integer tensor argument `t` as the kernels read it, for every entry point that takes
    one: checked for type, dtype, dimensions, batch and device without reading its values
    (that would wait for the GPU, and a step must not), and contiguous, since the kernels index
    it as dense (a column of a table, an expanded or strided view is copied: a few bytes).
    `what` and `fix` complete the type error; `owner` names what `device` belongs to. With
    `within` = (lo, hi) it is int32, wider values clamped into [lo, hi] first: the caller's
    documented rule for values past its range, which narrowing alone would wrap (2**32 + 5
    read as 5)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES or t.dim() != dims:
        got = f"a {t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be {what}, got {got}; {fix}")
    if batch is not None and t.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B] = [{batch}], one entry per sequence of q, got "
                         f"{tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but {owner} is on {device}; move it with .to({owner}.device)")
    if within is not None and t.dtype != torch.int32:
        t = (t.clamp(*within) if t.dtype == torch.int64 else t).to(torch.int32)
    return t.contiguous()


def check_head_dims(head_dim: int, head_dim_v: int, names=("q/k head dim", "v head dim")) -> None:
    for name, d in zip(names, (head_dim, head_dim_v)):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be between {MIN_HEAD_DIM} and {MAX_HEAD_DIM}, got {d}; "
                             f"pad or split the heads")


def check_captured(traces, device, *, gradients: bool = True) -> tuple[int, ...]:
    """Check the captured tensors of `traces` (mask, score) and return the slots (the mask's
    tensors numbered first, as codegen's merge numbers them) whose gradients the backward
    computes: the score mod's tensors that need one (captured_needing_grad). `gradients`: the
    call can compute them (decoding cannot)."""
    needing = set(map(id, captured_needing_grad(*traces)))
    slots, slot = [], 0
    for t in (t for t in traces if t is not None):
        for i, tensor in enumerate(t.tensors):
            # a CPU scalar serves any device, as in torch (captured_args copies it), but for its
            # gradient, which would land on the copy
            if tensor.device != device and not (serves_any_device(tensor) and not tensor.requires_grad):
                raise ValueError(f"{t.kind} '{t.name}' captured tensor #{i} lives on {tensor.device} but q is on "
                                 f"{device}; move the captured tensor to {device}")
            if id(tensor) in needing:
                if not gradients:
                    raise NotImplementedError(f"{t.kind} '{t.name}' captured tensor #{i} requires grad, but decoding "
                                              f"(kv_lens, paged_attention) computes no gradients; detach it, or run "
                                              f"under torch.no_grad()")
                if t.kind == "mask_mod":
                    raise ValueError(f"mask_mod '{t.name}' captured tensor #{i} requires grad, but a mask's values only "
                                     f"choose which pairs are kept and have no gradient; detach it")
                slots.append(slot)
            slot += 1
    return tuple(slots)


def check_block_map(bm: BlockMap, mask, traced, B: int, Hq: int, Lq: int, Lkv: int, device) -> None:
    """Refuse a map built for another mask, other parameter values, other captured tensors or
    other shapes (Lq × Lkv over the positions the mask sees): its FULL and EMPTY tiles would
    keep or skip pairs this call's mask does not."""
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
    tiles.check_block_size(bm.block_size, "block_map tile")
    bm.kernel_rows(B, Hq)
    if bm.device != device:
        raise ValueError(f"block_map lives on {bm.device} but q is on {device}; move it with "
                         f"block_map.to('{device}')")


def _built_for_another(bm: BlockMap, mask, traced) -> str | None:
    """How the call's mask differs from the one `bm` was built from, or None where it does not."""
    built = bm.traced
    theirs, ours = f"mask_mod '{bm.mask_name}'", f"the call's mask_mod '{mask.__name__}'"
    if built.signature != traced.signature:
        return f"was built for {theirs} ({built.expr}) but {ours} is {traced.expr}"
    if [p.value for p in built.params] != [p.value for p in traced.params]:
        return f"was built for {theirs} with {_values(built)} but {ours} has {_values(traced)}"
    for i, (then, now, (version, pointer)) in enumerate(zip(built.tensors, traced.tensors, bm.tensor_stamps)):
        if now is not then:
            return f"was built for {theirs} with its captured tensor #{i}, but {ours} captures another tensor there"
        if now._version != version:
            return (f"was built before captured tensor #{i} of {theirs} changed in place (version {version}, now "
                    f"{now._version})")
        if now.data_ptr() != pointer:
            return f"was built before captured tensor #{i} of {theirs} was given new storage (.data was assigned)"
    return None


def _values(traced) -> str:
    return ", ".join(f"{p.origin}={p.value}" for p in traced.params)


__all__ = ["BLOCK_MAPS", "PLANS", "Problem", "cached_block_map", "captured_args", "check_block_map",
           "check_captured", "check_head_dims", "check_tensors", "check_unchanged", "given",
           "held_bytes", "index_argument", "kernel_scale", "mask_of_call", "planned", "problem_of", "softmax_scale",
           "stamps_of", "traces_of"]
