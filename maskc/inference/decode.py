"""Decoding: few query rows against many keys, through the split-KV kernel
(templates/attention_decode.py.jinja), over contiguous keys or a paged cache.

Flash-Decoding: the query heads of one kv head are packed into one tile's rows, and the kv
tiles those rows keep are shared among num_splits programs whose partial results a combine
kernel merges by LSE. The kept tiles come from the call's one block map over logical
positions; the kernel reads each tile's verdict there, so EMPTY tiles cost a byte and FULL
ones run no mask code. How many splits: the block map's widest kept span and the GPU's
multiprocessors decide (`splits`), once per problem, so a step does no host work that
depends on data and can be captured in a CUDA graph.

Positions: with kv_lens, keys at positions >= kv_lens[b] are ignored and the Lq queries are
the last Lq tokens, at kv_lens[b] - Lq + i (FlashAttention's cache_seqlens); mask_mod and
score_mod see those positions, and the block map is built over kv_cap × kv_cap of them
without dense evaluation (see problem()).
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field

import torch

from maskc.analysis.blockmap import BlockMap
from maskc.analysis.build import row_wise
from maskc.errors import MaskcError
from maskc.runtime import capture, plan, state, tiles
from maskc.runtime.dtypes import dot_precision, interpreter_safe, triton_accumulator
from maskc.runtime.kernel import CompiledKernel, kernel_for
from maskc.runtime.launch import LaunchPlan, no_pairs, outputs
from maskc.runtime.tiles import TileConfig, padded
from maskc.settings import plan_cache_max_size

_log = logging.getLogger(__name__)

# compiled_attention decodes where no gradient is wanted and Lq · (Hq / Hkv) is at most this:
# the packed rows fit one 64-row tile, which the prefill kernel would give a single q row.
MAX_ROWS = 64
MAX_SPLITS = 64
# Programs of the decoding kernel resident per multiprocessor: at D=128 with 64-key tiles and
# three stages, K and V take 96 KiB of shared memory per program (an H100 has 227 KiB).
PROGRAMS_PER_SM = 2
# What a split costs beside its tiles, in tiles: its prologue, its partial result's write and
# the combine's read of it.
SPLIT_COST_TILES = 2


def _decode_bytes(found: "Decode") -> dict:
    return plan.held_bytes((*found.captured.values(), *found.tables.values()), found.held, (found.block_map,))


# bounded by the bytes its entries keep alive as well as by count, as plan.PLANS
DECODES = state.lru(__name__, "DECODES", "the decoding plan of each call signature with kv_lens or a paged cache",
                    64, _decode_bytes, plan_cache_max_size)


@dataclass(eq=False)
class Decode:
    """One decoding problem after validation: what the launches need besides the tensors."""

    mask: object  # Traced or None
    score: object  # Traced or None
    scale: float
    B: int
    Hq: int
    Hkv: int
    Lq: int
    kv_cap: int  # key positions planned for: the keys given, or with kv_lens planned_keys() of them
    D: int
    Dv: int
    dtype: torch.dtype
    config: TileConfig
    block_map: BlockMap  # over logical positions: (kv_cap × kv_cap) with kv_lens, else (Lq × kv_cap)
    kernel: CompiledKernel
    captured: dict
    tables: dict  # the map's STATES, SPAN_LO, SPAN_HI and strides for the kernel
    splits: int
    held: tuple  # the captured tensors' storages, while the key holds their pointers (Traced.stamps)
    launches: dict = field(default_factory=dict)

    @property
    def interpret(self) -> bool:
        return self.block_map.device.type != "cuda"

    @property
    def group(self) -> int:
        return self.Hq // self.Hkv


def wanted(q, k, differentiable: bool, block_map: BlockMap | None = None) -> bool:
    """Whether compiled_attention takes the decoding kernel for these inputs (kv_lens aside). It
    evaluates the mask on FULL tiles and on the union of its rows' spans, so a block map whose
    tiles disagree with its mask (BlockMap.agrees_with_mask) runs on the prefill kernel."""
    return (not differentiable and q.shape[2] * (q.shape[1] // max(k.shape[1], 1)) <= MAX_ROWS
            and (block_map is None or block_map.agrees_with_mask))


def problem(q, kv_shape, mask_mod, score_mod, scale, *, lens: bool, block_map: BlockMap | None = None) -> Decode:
    """The Decode of a call with queries q and keys of shape kv_shape = (Hkv, kv_cap, D, Dv),
    remembered by everything it depends on; `lens`: the call gives kv_lens."""
    B, Hq, Lq, D = q.shape
    Hkv, kv_cap, _, Dv = kv_shape  # kv_cap: the positions planned for, the keys' length or more
    traces = plan.traces_of(mask_mod, score_mod)
    plan.check_captured(traces, q.device, gradients=False)
    map_q = kv_cap if lens else Lq
    if block_map is not None:
        try:
            plan.check_block_map(block_map, mask_mod, traces[0], B, Hq, map_q, kv_cap, q.device)
        except ValueError as error:
            if not lens:
                raise
            raise ValueError(f"{error} (with kv_lens, queries sit at positions up to kv_len, so the map is built over "
                             f"kv_len × kv_len: maskc.block_map(mask, {kv_cap}, {kv_cap}))") from None
        if not block_map.agrees_with_mask:
            raise MaskcError(f"the decoding kernel (kv_lens) needs a block_map whose tiles agree with its mask_mod "
                             f"(it evaluates '{block_map.mask_name}' on FULL tiles and across its rows' spans), got "
                             f"one listing EMPTY or FULL tiles the mask_mod disagrees with (a hand-made BlockMask); "
                             f"call without kv_lens, where the prefill kernels read it exactly, or build the map "
                             f"from the mask (maskc.block_map, create_block_mask)")
    key = (*map(id, traces), id(block_map), q.dtype, q.device, q.shape, kv_shape, scale, lens, plan.stamps_of(traces),
           tiles.override_key())
    found = DECODES.get(key)
    if found is not None:
        return found
    capture.refuse_capture(q.device)
    config = tiles.decode_config(D, q.device.type, Lq * (Hq // Hkv))
    tiles.check_block_size((config.block_m, config.block_n), "decoding kernel tile")
    m, s = traces
    if block_map is None:
        # With kv_lens the map covers every position a query may take, kv_cap × kv_cap: the
        # lengths stay on the device, and reading them would wait for it. Tiles the analysis
        # leaves unsure stay PARTIAL, for the kernel to settle over the rows the queries take:
        # settling them here would evaluate the mask on up to kv_cap² pairs (14-26 s at 16384
        # keys on the dev CPU). A mask analysed tile by tile gets q tiles that bound the map's.
        by_tiles = lens and m is not None and not row_wise(m.expr)
        map_block = tiles.decode_map_block(q.device.type, *((map_q, -(-kv_cap // config.block_n)) if by_tiles else ()))
        block_map = plan.cached_block_map(mask_mod, m, map_q, kv_cap, (map_block, config.block_n), B, Hq, q.device,
                                          settle=not lens)
    tables, widest = _tables(block_map, config.block_n, Hq // Hkv)
    rows = B * Hkv * -(-Lq * (Hq // Hkv) // config.block_m)
    splits = tiles.decode_splits() or choose_splits(rows, -(-widest // config.block_n), q.device)
    config = tiles.decode_config(D, q.device.type, Lq * (Hq // Hkv), split=splits > 1)
    found = Decode(m, s, plan.softmax_scale(scale, D), B, Hq, Hkv, Lq, kv_cap, D, Dv,
                   q.dtype, config, block_map, kernel_for("dec", m, s, q.dtype, q.device),
                   plan.captured_args(m, s, q.dtype, q.device)[0], tables,
                   splits, tuple(x for t in traces if t is not None for x in t.storages()))
    DECODES.put(key, found)
    _log.debug("decoding B=%d Hq=%d Hkv=%d Lq=%d over %d keys%s: the split-KV kernel in %d split%s (%d query rows a "
               "kv head, no gradients)", B, Hq, Hkv, Lq, kv_cap, " (kv_lens)" if lens else "", splits,
               "" if splits == 1 else "s", Lq * (Hq // Hkv))
    return found


def choose_splits(rows: int, tiles_per_row: int, device: torch.device) -> int:
    """How many programs share each row's kept kv tiles: the count with the least estimated
    time, in waves of programs over the multiprocessors times the tiles each program runs.
    `rows` programs (b × kv head × tiles of packed rows) each keep up to `tiles_per_row` tiles,
    the block map's widest kept span: splitting that, not the full length, is what keeps a
    sliding window's few tiles from going to one program each."""
    if tiles_per_row <= 1:
        return 1
    slots = _multiprocessors(device) * PROGRAMS_PER_SM
    best, chosen = math.inf, 1
    for n in range(1, min(tiles_per_row, MAX_SPLITS) + 1):
        waves = -(-rows * n // slots)
        cost = waves * (-(-tiles_per_row // n) + (SPLIT_COST_TILES if n > 1 else 0))
        if cost < best:
            best, chosen = cost, n
    return chosen


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a small machine, so that tests see several splits
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tables(bm: BlockMap, block_n: int, group: int) -> tuple[dict, int]:
    """The kernel's view of the map: its verdicts at kv tiles of block_n (or a multiple), each
    row's kept span and whether EMPTY tiles lie inside it, and the widest span in keys."""
    m_block = bm.block_size[0]
    kv_map, _, kv_multiple = bm.for_tiles(m_block, block_n)
    dense = kv_map.to_dense()  # [B', H', q tiles, kv tiles]
    kept = dense != 0
    n_kv = dense.shape[-1]
    any_kept = kept.any(-1)
    lo = torch.where(any_kept, kept.int().argmax(-1), n_kv).to(torch.int32)
    hi = torch.where(any_kept, n_kv - kept.flip(-1).int().argmax(-1), 0).to(torch.int32)
    holes = ((hi - lo).clamp(min=0) > kept.sum(-1)).to(torch.int8)
    widest = int((hi - lo).clamp(min=0).max()) * kv_map.block_size[1] if lo.numel() else 0
    row_b, row_h = kv_map.row_strides
    return dict(STATES=dense.contiguous(), SPAN_LO=lo.contiguous(), SPAN_HI=hi.contiguous(), HOLES=holes.contiguous(),
                STATE_STRIDE_B=row_b, STATE_STRIDE_H=row_h,
                map_q_tiles=kv_map.n_q, map_kv_tiles=n_kv, MAP_BLOCK_M=m_block, KV_MULTIPLE=kv_multiple,
                MAP_HEADS=group if kv_map.H > 1 else 1), widest


# -- entry points ----------------------------------------------------------------------------
def contiguous(q, k, v, mask_mod, score_mod, scale, kv_lens=None, block_map: BlockMap | None = None):
    """(out, lse) of decoding over k and v [B, Hkv, Lkv, D], checked (q, k and v already are):
    compiled_attention's path for kv_lens and few query rows, eager or in its operator."""
    lens = None if kv_lens is None else check_lens(kv_lens, q, k)
    n = k.shape[2] if lens is None or block_map is not None else planned_keys(k.shape[2])
    found = problem(q, (k.shape[1], n, q.shape[3], v.shape[3]), mask_mod, score_mod, scale, lens=lens is not None,
                    block_map=block_map)
    return run(found, q, k, v, kv_lens=lens)


def planned_keys(n: int) -> int:
    """How many key positions a call with kv_lens over n keys is planned for (without a block
    map of the caller's): n rounded up to 256, or to an eighth of its power of two. A cache that
    grows a token a step (transformers' dynamic cache) then finds one plan for many steps, not
    a new block map and plan each; contiguous keys and a paged cache of one capacity get one
    plan, and the same bits. The kernel reads the keys below kv_lens, clamped to the keys'
    real count (a per-call value), so the map's positions past it are never reached."""
    step = max(256, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


def paged(q, k_pages, v_pages, page_table, lens, seq_ids, page_size: int, mask_mod, score_mod, scale,
          enable_gqa: bool):
    """(out, lse) of decoding over a paged cache's tensors (PagedKVCache's fields), checked:
    paged_attention's path, eager or in its operator."""
    B = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else 0
    if isinstance(q, torch.Tensor) and q.dtype != k_pages.dtype:
        raise TypeError(f"q is {q.dtype} but the cache holds {k_pages.dtype}; cast q")
    Hkv = k_pages.shape[2]
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        if q.shape[3] != k_pages.shape[3]:
            raise ValueError(f"q's head dim is {q.shape[3]} but the cache's head_dim is {k_pages.shape[3]}; q must "
                             f"match the cache it reads")
        if q.shape[1] != Hkv and not (enable_gqa and q.shape[1] % Hkv == 0):
            fix = ("pass enable_gqa=True for grouped-query attention" if q.shape[1] % Hkv == 0 else
                   "grouped-query attention needs a multiple of them")
            raise ValueError(f"q has {q.shape[1]} heads and the cache {Hkv} kv heads; {fix}")
    # empty stand-ins for k and v, so that q is checked against the cache as against keys
    plan.check_tensors(q, k_pages.new_empty((B, Hkv, 0, k_pages.shape[3])),
                       v_pages.new_empty((B, Hkv, 0, v_pages.shape[3])), enable_gqa)
    if torch.is_grad_enabled() and q.requires_grad:
        raise NotImplementedError("paged_attention runs without gradients; call it under torch.no_grad() or "
                                  "detach q")
    if q.device != k_pages.device:
        raise ValueError(f"q is on {q.device} but the cache on {k_pages.device}; move q")
    slots = check_slots(seq_ids, q, page_table.shape[0])
    # the cache's own tables, contiguous int32 unless replaced by hand: checked as any argument
    page_table, lens = (plan.index_argument(name, t, what=f"a {dims}-d integer tensor",
                                            fix="leave the cache's tables as it made them",
                                            device=k_pages.device, owner="k_pages", dims=dims)
                        for name, t, dims in (("page_table", page_table, 2), ("lens", lens, 1)))
    _, Hq, Lq, D = q.shape
    capacity = page_table.shape[1] * page_size
    if Lq > capacity:
        raise ValueError(f"q has {Lq} queries but a sequence of this cache holds at most {capacity} tokens; "
                         f"make the cache's max_pages_per_seq larger")
    if 0 in (B, Hq, Lq):
        return no_pairs(q, v_pages)  # (reads v's last dim: the pages' Dv)
    found = problem(q, (Hkv, planned_keys(capacity), D, v_pages.shape[3]), mask_mod, score_mod, scale, lens=True)
    return run(found, q, k_pages, v_pages, kv_lens=lens, page_table=page_table, slots=slots, page_size=page_size)


def check_lens(kv_lens, q, k) -> torch.Tensor:
    """kv_lens as the kernel reads it (contiguous int32 [B] on q's device), after checking what
    can be checked without reading it: reading would wait for the GPU, and a step must not. An
    int64 entry past int32 is clamped to [0, Lkv] first, the kernel's own rule (a length
    above the keys' reads as theirs, one below 0 keeps no key), where narrowing would wrap it."""
    B, _, Lq, _ = q.shape
    lens = plan.index_argument("kv_lens", kv_lens, what="an integer tensor [B] of key counts",
                               fix="build it with torch.tensor(lengths, dtype=torch.int32, device=q.device)",
                               device=q.device, owner="q", batch=B, within=(0, k.shape[2]))
    if Lq > k.shape[2]:
        raise ValueError(f"q has {Lq} queries but k only {k.shape[2]} keys; with kv_lens the queries are the last "
                         f"Lq of the keys, so k must hold at least Lq")
    return lens


def check_slots(seq_ids, q, num_slots: int) -> torch.Tensor:
    """seq_ids as the kernel reads it (contiguous int32 [B] on q's device). An int64 entry past
    int32 is clamped to [-1, num_slots] first: outside the cache's slots, where the kernel
    reads it as an empty sequence, as it does any slot outside them."""
    return plan.index_argument("seq_ids", seq_ids, what="an integer tensor [B] of cache slots",
                               fix="pass torch.tensor(slots, dtype=torch.int32, device=q.device)", device=q.device,
                               owner="q", batch=q.shape[0], within=(-1, num_slots))


def replayable(q, k, v, mask_mod, score_mod, scale, kv_lens):
    """contiguous() with kv_lens for a call whose plan depends on its shapes alone: mods that
    capture no tensor and no number, and no block map. What a CUDA graph of it replays (the
    `maskc::decode_replayable` operator) is then right for any kv_lens and any inputs of those
    shapes. The plan is built outside the graph's memory pool and kept for the process, since a
    recorded graph reads its tables with no Python running."""
    traces = plan.traces_of(mask_mod, score_mod)
    for t in traces:
        if t is not None and (t.tensors or t.params):
            raise MaskcError(f"a CUDA graph of maskc's decoding replays the plan of its recording, so the replayable "
                             f"operator takes only mods whose plan depends on shapes alone, got {t.kind} '{t.name}' "
                             f"capturing {len(t.tensors)} tensor(s) and {len(t.params)} number(s) ({t.expr}); pass "
                             f"positions through kv_lens, or call compiled_attention, whose operator runs outside "
                             f"CUDA graphs")
    lens = check_lens(kv_lens, q, k)
    kv_shape = (k.shape[1], planned_keys(k.shape[2]), q.shape[3], v.shape[3])
    # (the plan holds the traces, so their ids stay theirs)
    key = (*map(id, traces), q.dtype, q.device, q.shape, kv_shape, scale)
    found = REPLAYED.get(key)
    if found is None:
        found = REPLAYED[key] = capture.outside_graph_pool(
            lambda: problem(q, kv_shape, mask_mod, score_mod, scale, lens=True), q.device)
    return run(found, q, k, v, kv_lens=lens)


# The plans replayable() ran, which recorded CUDA graphs may read: never dropped.
REPLAYED: dict = {}
state.register(__name__, "REPLAYED", "the decoding plan of each call signature run by the replayable decoding operator",
               "one entry per signature, kept for the process (not cleared): a recorded CUDA graph reads its "
               "tables", size=lambda: len(REPLAYED), clear=None)


# -- launches --------------------------------------------------------------------------------
# each tensor's stride parameters: q and out over (b, h, m, d), k and v over (b, h, n, d)
_STRIDES = {name: tuple(f"stride_{name}{c}" for c in ("bhmd" if name in "qo" else "bhnd")) for name in "qkvo"}


def run(problem: Decode, q, k, v, *, kv_lens=None, page_table=None, slots=None, page_size: int = 0):
    """(out, lse) of a decoding problem. k and v are [B, Hkv, kv_cap, D] tensors, or with
    page_table the cache's pages [pages, page_size, Hkv, D]."""
    dtype = q.dtype
    given = q
    q, k, v = interpreter_safe(q, k, v)  # (a copy on the interpreter may have other strides)
    out, lse = outputs(given, problem.Dv, q.dtype)
    paged = page_table is not None
    variant = (kv_lens is not None, paged, slots is not None, page_size)
    decode, combine, part_sizes = problem.launches.get(variant) or _plans(problem, *variant)
    if paged:
        # pages [pages, page_size, Hkv, D]: the kernel's (b, h, n, d) strides are (page, head, row, d)
        (kp, kr, kh, kd), (vp, vr, vh, vd) = k.stride(), v.stride()
        kv_strides = (kp, kh, kr, kd, vp, vh, vr, vd)
    else:
        kv_strides = (*k.stride(), *v.stride())
    out_strides = out.stride()
    keys = page_table.shape[1] * page_size if paged else k.shape[2]  # what the kernel may read
    # the per-call values in _plans' order
    values = (q, k, v, out, lse, *q.stride(), *kv_strides, *out_strides, keys)
    if combine is not None:
        # PartOut's elements then PartLse's, in one allocation: the kernels take their pointers
        parts = torch.empty(part_sizes[0] + part_sizes[1], dtype=lse.dtype, device=q.device)
        part_out, part_lse = parts, parts[part_sizes[0]:]
        values += (part_out, part_lse)
    if kv_lens is not None:
        values += (kv_lens,)
    if paged:
        values += (page_table, page_table.stride(0), page_table.shape[0])
    if slots is not None:
        values += (slots,)
    decode(*values)
    if combine is not None:
        combine(out, lse, part_out, part_lse, *out_strides)
    return (out if out.dtype == dtype else out.to(dtype)), lse


def _plans(problem: Decode, lens: bool, paged: bool, slots: bool, page_size: int):
    """The decoding launch, the combine's if any, and then the sizes of the partial results
    (PartOut's and PartLse's elements) it merges."""
    config = problem.config
    split = problem.splits > 1
    # run passes the per-call values in this order
    per_call = ["Q", "K", "V", "Out", "Lse", *_STRIDES["q"], *_STRIDES["k"], *_STRIDES["v"], *_STRIDES["o"], "kv_cap"]
    fixed = dict(PartOut=None, PartLse=None, KvLens=None, PageTable=None, Slots=None, stride_pt=0, num_slots=0)
    for name, wanted_here in (("PartOut", split), ("PartLse", split), ("KvLens", lens), ("PageTable", paged),
                              ("stride_pt", paged), ("num_slots", paged), ("Slots", slots)):
        if wanted_here:
            per_call.append(name)
            del fixed[name]
    scale = plan.kernel_scale(problem.scale, problem.score is not None)
    acc = triton_accumulator(problem.dtype)
    fixed.update(problem.tables, **problem.captured, num_kv_heads=problem.Hkv, q_len=problem.Lq,
                 qk_scale=scale, GROUP=problem.group, HEAD_DIM=problem.D,
                 HEAD_DIM_V=problem.Dv, D_PAD=padded(problem.D), DV_PAD=padded(problem.Dv), BLOCK_M=config.block_m,
                 BLOCK_N=config.block_n, num_splits=problem.splits, DIRECT=not split, HAS_LENS=lens, SLOTS=slots,
                 PAGED=paged, PAGE_SIZE=max(page_size, 1), ACC=acc, DOT_PRECISION=dot_precision(problem.dtype),
                 NUM_STAGES=config.num_stages)
    n_tiles = -(-problem.Lq * problem.group // config.block_m)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    decode = LaunchPlan(problem.kernel, "attention_decode", problem.interpret,
                        (problem.splits, problem.B * problem.Hkv, n_tiles), fixed, tuple(per_call), options)
    combine, part_sizes = None, None
    if split:
        part_rows = problem.splits * problem.B * problem.Hkv * problem.Lq * problem.group
        part_sizes = (part_rows * padded(problem.Dv), part_rows)
        combine = LaunchPlan(
            problem.kernel, "attention_combine", problem.interpret, (problem.B * problem.Hkv, n_tiles),
            dict(num_kv_heads=problem.Hkv, q_len=problem.Lq, GROUP=problem.group, HEAD_DIM_V=problem.Dv,
                 DV_PAD=padded(problem.Dv), BLOCK_M=config.block_m, num_splits=problem.splits,
                 SPLITS_PAD=max(2, 1 << (problem.splits - 1).bit_length()), ACC=acc),
            ("Out", "Lse", "PartOut", "PartLse", *_STRIDES["o"]), dict(num_warps=4))
    problem.launches[(lens, paged, slots, page_size)] = plan_ = (decode, combine, part_sizes)
    return plan_


__all__ = ["Decode", "MAX_ROWS", "REPLAYED", "check_lens", "check_slots", "choose_splits", "contiguous", "paged",
           "planned_keys", "problem", "replayable", "run", "wanted"]
