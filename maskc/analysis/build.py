"""block_map(): analyse a traced mask into a BlockMap without evaluating it pair by pair.

Each comparison `a*kv_idx + R >= 0` whose kv_idx part is a plain multiple becomes, per
q-tile row, two thresholds along kv (O(rows) work). Other comparisons get per-tile
interval verdicts (O(tiles)). Verdicts combine through & | ~ ^ as row pieces; a mask made
of thresholds and comparisons free of kv_idx alone is evaluated at once, in numpy on the
host (rows.py). Tiles left PARTIAL without certainty (two PARTIAL atoms meeting, an
undecidable operation) are settled by evaluating the mask on those tiles alone.
"""
from __future__ import annotations

import functools
import logging
import operator
import time

import numpy as np
import sympy
import torch

from maskc._graph import outside_graph
from maskc.analysis import dense
from maskc.analysis.blockmap import BlockMap
from maskc.analysis.classify import EMPTY, FULL, PARTIAL, _Undecidable, classify_grid
from maskc.analysis.intervals import Interval, IntervalEvaluator, TensorSummaries
from maskc.analysis._shapes import broadcast
from maskc.analysis.pieces import OPS, Pieces, pack
from maskc.analysis.rows import Cuts, HostPieces, row_pieces
from maskc.trace import dag
from maskc.trace import symbols as S
from maskc.trace.mods import as_mask_mod

_log = logging.getLogger(__name__)
# Dense settling evaluates about this many pairs at a time.
_SETTLE_CHUNK = 1 << 22


def block_map(mask_mod, q_len: int, kv_len: int, *, block_size=(128, 128), B: int | None = None,
              H: int | None = None, device=None) -> BlockMap:
    """Classify every tile of the q_len × kv_len attention matrix as FULL, PARTIAL or EMPTY.

    >>> bm = maskc.block_map(maskc.masks.sliding_window(1024), q_len=8192, kv_len=8192)
    >>> print(bm)

    B and H are needed only when the mask reads b or h; the map then has one set of rows
    per (b, h), otherwise one shared set.
    """
    mm = as_mask_mod(mask_mod)
    return block_map_of_trace(mm, mm.traced, q_len, kv_len, block_size=block_size, B=B, H=H, device=device)


# Dynamo cannot trace maskc's analysis (sympy, numpy): called inside compiled code it runs
# outside the graph (a graph break), which fullgraph=True refuses with this reason.
IN_PYTHON = ("maskc analyses a mask in Python, outside torch.compile's graph; with fullgraph=True build the "
             "block map (or block mask) outside the compiled function, once for its lengths, and pass it in, or "
             "compile without fullgraph")
block_map = outside_graph(block_map, IN_PYTHON)


MAX_LENGTH = 2**31 - 1


def _length(name: str, value) -> int:
    """A sequence length as an int: Python's, numpy's, or a 0-d integer tensor's (torch's
    create_block_mask takes each: lingua passes `lengths.sum()`)."""
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or isinstance(value, bool) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}; pass the sequence length")
    if n > MAX_LENGTH:
        raise ValueError(f"{name} must be at most 2**31 - 1, as maskc's kernels hold positions in int32, got {n}; "
                         f"pass a shorter length")
    return n


def block_map_of_trace(mm, traced, q_len: int, kv_len: int, *, block_size=(128, 128), B: int | None = None,
                       H: int | None = None, device=None, settle: bool = True) -> BlockMap:
    """block_map() of one trace of the MaskMod `mm`: the runtime builds the maps of a call from
    the trace its kernel runs with, read once per call, not from a later re-trace of `mm`.
    `settle=False` leaves the tiles analysis cannot decide PARTIAL (still sound: the kernel
    evaluates the mask there) rather than evaluating the mask on all their pairs."""
    start = time.perf_counter()
    bm, bn = block_size = _block_size(block_size)
    q_len, kv_len = _length("q_len", q_len), _length("kv_len", kv_len)
    free = _free_symbols(traced.expr)
    n_b = _dim(mm, free, S.B, B, "B", "batch size")
    n_h = _dim(mm, free, S.H, H, "H", "number of query heads")
    device = _normalise(torch.device(device) if device is not None else _tensor_device(traced.tensors))
    for i, t in enumerate(traced.tensors):
        if t.device != device and not serves_any_device(t):
            raise ValueError(f"mask_mod '{mm.__name__}' captured tensor #{i} on {t.device} but the block map is "
                             f"built on {device}; move the tensor or pass device={t.device}")
    work = _work_device(traced, device)
    ctx = _Analysis(traced, traced.param_values(), q_len, kv_len, bm, bn, n_b, n_h, work, device)
    pieces = ctx.host_pieces(traced.expr) if work.type == "cpu" and row_wise(traced.expr) else None
    if pieces is None:
        pieces = ctx.pieces(traced.expr)
    pieces = pieces.expand(broadcast(pieces.starts.shape[:3], (1, 1, ctx.n_q)))
    if settle:
        pieces = ctx.settle(pieces)
    result = BlockMap(pieces, q_len=q_len, kv_len=kv_len, block_size=block_size, mask_name=mm.__name__, mask_mod=mm,
                      traced=traced, device=device)
    if _log.isEnabledFor(logging.INFO):  # the counts read the map back from its device
        _log.info("block map of '%s' at %d×%d, %d×%d tiles on %s in %.1f ms: %d FULL, %d PARTIAL, %d EMPTY",
                  mm.__name__, q_len, kv_len, bm, bn, device, (time.perf_counter() - start) * 1e3, result.num_full,
                  result.num_partial, result.num_empty)
    return result


def _work_device(traced, target: torch.device) -> torch.device:
    """Where the analysis runs. A mask made of thresholds along kv (causal, sliding window,
    prefix-LM) costs O(rows) in a few dozen small steps: on a GPU each would be a kernel
    launch and each count a host sync, so the host runs them (in numpy, rows.py) and the
    finished map crosses in one copy. Captured tensors and per-tile verdicts stay on the
    target device."""
    if target.type == "cpu" or traced.tensors or not row_wise(traced.expr):
        return target
    return torch.device("cpu")


def _block_size(block_size) -> tuple[int, int]:
    if isinstance(block_size, int):
        block_size = (block_size, block_size)
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(isinstance(b, int) and b >= 1 for b in block_size)):
        raise ValueError(f"block_size must be a positive int or a pair (q_block, kv_block), got {block_size!r}")
    return tuple(block_size)


def _dim(mm, free, symbol, given, name, meaning) -> int:
    if symbol not in free:
        return 1
    if given is None:
        raise ValueError(f"mask_mod '{mm.__name__}' reads {symbol}, so the block map differs per {symbol}; "
                         f"pass {name}= (the {meaning})")
    return int(given)


def _normalise(device: torch.device) -> torch.device:
    """'cuda' means the current CUDA device: name its index so comparisons with tensors hold."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _tensor_device(tensors):
    placed = [t for t in tensors if not serves_any_device(t)]
    return placed[0].device if placed else torch.device("cpu")


def serves_any_device(t: torch.Tensor) -> bool:
    """A 0-d CPU tensor: torch lets it meet tensors of any device, as a number, and so does maskc
    (the kernels read a copy on their device). transformers' Gemma 3 makes one inside its
    bidirectional mask (`lambda *args: torch.tensor(True)`)."""
    return t.dim() == 0 and t.device.type == "cpu"


class _Analysis:
    """One build: frames of tile bounds on the work device, verdicts as row pieces."""

    def __init__(self, traced, values, q_len, kv_len, bm, bn, n_b, n_h, device, target):
        self.traced, self.values = traced, values
        self.q_len, self.kv_len, self.bm, self.bn = q_len, kv_len, bm, bn
        self.n_b, self.n_h = n_b, n_h
        self.n_q, self.n_kv = -(-q_len // bm), -(-kv_len // bn)
        self.device, self.target = device, target
        self.summaries = TensorSummaries(traced.tensors, device)

    @functools.cached_property
    def rows(self) -> IntervalEvaluator:
        """Ranges over each q-tile row (b, h and q_idx bound; kv_idx free)."""
        frame = {S.Q_IDX: self._bounds(S.Q_IDX, self.n_q, self.bm, self.q_len, (1, 1, -1, 1))}
        for symbol, n, shape in ((S.B, self.n_b, (-1, 1, 1, 1)), (S.H, self.n_h, (1, -1, 1, 1))):
            if symbol in _free_symbols(self.traced.expr):
                index = torch.arange(n, device=self.device).view(shape)
                frame[symbol] = Interval(index, index, True, True, frozenset([symbol]))
        return IntervalEvaluator(frame, self.values, self.summaries, self.device)

    @functools.cached_property
    def tiles(self) -> IntervalEvaluator:
        """Ranges over each tile."""
        frame = dict(self.rows.frame)
        frame[S.KV_IDX] = self._bounds(S.KV_IDX, self.n_kv, self.bn, self.kv_len, (1, 1, 1, -1))
        return IntervalEvaluator(frame, self.values, self.summaries, self.device)

    def _bounds(self, symbol, n, size, length, shape) -> Interval:
        lo = torch.arange(0, n * size, size, device=self.device)
        hi = (lo + (size - 1)).clamp_(max=length - 1)
        return Interval(lo.view(shape), hi.view(shape), True, True, frozenset([symbol]))

    # -- boolean structure --------------------------------------------------------------------
    def pieces(self, e) -> Pieces:
        if e is sympy.true or e is sympy.false:
            return self._uniform(_keys((FULL if e is sympy.true else EMPTY,), True, self.device))
        if isinstance(e, (sympy.And, sympy.Or, sympy.Xor)):
            op = OPS[type(e).__name__.lower()]
            parts = [self.pieces(a) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = out.combine(p, op)
            return out
        if isinstance(e, sympy.Not):
            return self.pieces(e.args[0]).negate()
        if not _reads_kv(e):
            return self._uniform(pack(*classify_grid(e, self.rows)))
        threshold = self._threshold(e)
        if threshold is not None:
            return threshold
        cls, certain = classify_grid(e, self.tiles)
        shape = broadcast(cls.shape, (1, 1, self.n_q, self.n_kv))
        return Pieces.from_grid(cls.expand(shape), certain.expand(shape), shape[:3])

    def _uniform(self, key) -> Pieces:
        """One piece per row: a verdict that does not depend on kv_idx."""
        shape = broadcast(key.shape, (1, 1, 1, 1))
        return Pieces(torch.zeros(shape, dtype=torch.int64, device=self.device), key.expand(shape), self.n_kv)

    # -- comparisons linear in kv_idx: thresholds per row ----------------------------------
    def _threshold(self, rel) -> Pieces | None:
        cuts = self._cuts(rel, host=False)
        if cuts is None:
            return None
        first, second = torch.broadcast_tensors(cuts.first, cuts.second)
        starts = torch.stack([torch.zeros_like(first), first, second], dim=-1)
        return Pieces(starts, cuts.keys.expand(starts.shape), self.n_kv)

    def _cuts(self, rel, host: bool) -> Cuts | None:
        """Where rel's verdict changes along each row, as numpy arrays on the host or tensors."""
        form = _threshold_form(rel, self.values)
        if form is None:
            return None
        a, bound = form
        try:
            r = self.rows.run(bound)
        except _Undecidable:
            return None
        if r.lo.dtype != torch.int64:
            return None
        # the bounds per row, [B', H', n_q] or broadcastable to it
        lo, hi = (x.numpy() if host else x for x in (r.lo, r.hi))
        lo, hi = (x.reshape(broadcast(x.shape, (1, 1, 1, 1)))[..., 0] for x in (lo, hi))
        # The cuts come out ordered without a max or min: lo <= hi, and tiles wholly before a
        # position never outnumber tiles starting before it.
        if a > 0:
            # kv kept from ceil(bound / a): by some q of the row from the lowest bound, by all from the highest
            cuts, order = (self._tile_at(_ceildiv(lo, a)), self._tiles_before(_ceildiv(hi, a))), (EMPTY, PARTIAL, FULL)
        else:
            # kv kept up to floor(bound / -a): by some q up to the highest bound, by all up to the lowest
            cuts, order = ((self._tile_at(_floordiv(lo, -a) + 1), self._tiles_before(_floordiv(hi, -a) + 1)),
                           (FULL, PARTIAL, EMPTY))
        if host:  # tiles fit in int32, and the host's pieces are made of them
            return Cuts(*(c.astype(np.int32) for c in cuts), _keys(order, r.tight, None))
        return Cuts(*cuts, _keys(order, r.tight, self.device))

    def _tile_at(self, kv):
        """The tile holding kv position `kv`: 0 before the first, n_kv past the last. It is
        also how many tiles lie wholly before `kv`."""
        return _floordiv(_clip(kv, 0, self.kv_len - 1), self.bn) + (kv >= self.kv_len)

    def _tiles_before(self, kv):
        """How many tiles start before kv position `kv`."""
        return _clip(_ceildiv(kv, self.bn), 0, self.n_kv)

    # -- row-wise expressions, on the host --------------------------------------------------
    def host_pieces(self, e) -> HostPieces | None:
        """The pieces of a row-wise expression (see row_wise), worked out on the host by
        rows.py, or None where a threshold has no row bounds."""
        leaves = {}
        for atom in _atoms(e):
            leaves[atom] = self._cuts(atom, host=True) if _reads_kv(atom) else self._row_key(atom)
            if leaves[atom] is None:
                return None
        return row_pieces(e, leaves, self.n_q, self.n_kv)

    def _row_key(self, atom) -> np.ndarray:
        """The key of a comparison free of kv_idx, per row: int8 [B', H', n_q, 1]."""
        key = pack(*classify_grid(atom, self.rows))
        return key.reshape(broadcast(key.shape, (1, 1, 1, 1))).numpy().astype(np.int8)

    # -- dense settling of uncertain tiles ----------------------------------------------------
    def settle(self, pieces: Pieces | HostPieces) -> Pieces | HostPieces:
        """Evaluate the mask on the tiles whose verdict is unsure; dense work runs on the target."""
        if not pieces.unsure():
            return pieces
        shape = (self.n_b, self.n_h, self.n_q, self.n_kv)
        cls, certain = pieces.to(self.target).expand(shape[:3]).to_grid()
        todo = ((cls == PARTIAL) & ~certain).nonzero()
        per_chunk = max(1, _SETTLE_CHUNK // (self.bm * self.bn))
        for chunk in todo.split(per_chunk):
            cls[tuple(chunk.T)] = self._dense_verdict(chunk)
        return Pieces.from_grid(cls, torch.ones_like(cls, dtype=torch.bool), shape[:3])

    def _dense_verdict(self, tiles):
        b, h, i, j = (t.view(-1, 1, 1) for t in tiles.T)
        q = i * self.bm + torch.arange(self.bm, device=self.target).view(1, -1, 1)
        kv = j * self.bn + torch.arange(self.bn, device=self.target).view(1, 1, -1)
        valid = (q < self.q_len) & (kv < self.kv_len)
        env = dense.symbols_env(b, h, q.clamp(max=self.q_len - 1), kv.clamp(max=self.kv_len - 1))
        keep = dense.evaluate(self.traced.expr, env, self.traced.tensors, self.values)
        keep = keep.expand(valid.shape) & valid
        any_kept = keep.any(-1).any(-1)
        all_kept = (keep | ~valid).all(-1).all(-1)
        out = torch.full(any_kept.shape, PARTIAL, dtype=torch.int8, device=self.target)
        out[all_kept] = FULL
        out[~any_kept] = EMPTY
        return out


# -- sympy work, cached per expression and independent of parameter values: a mask is analysed
# at many lengths, tile sizes and parameter values, and this costs more than the tensor steps --
@functools.lru_cache(maxsize=1024)
def _free_symbols(e) -> frozenset:
    return dag.free_symbols(e)


@functools.lru_cache(maxsize=1024)
def _reads_kv(e) -> bool:
    return S.KV_IDX in dag.free_symbols(e)


@functools.lru_cache(maxsize=1024)
def _kv_linear(rel):
    """(a, rest) when rel is a*kv_idx + rest >= 0 over the integers, rest free of kv_idx; else None."""
    if not isinstance(rel, sympy.GreaterThan):
        return None
    diff = rel.lhs - rel.rhs
    if not diff.is_integer:
        return None
    rest, kv_part = diff.as_independent(S.KV_IDX, as_Add=True)
    if S.KV_IDX in rest.free_symbols:
        return None
    # term by term, never sympy.simplify: a bit-interleaving (Morton) mask's atoms run to
    # hundreds of operations, where simplify took minutes to say "not linear"
    a = sympy.Integer(0)
    for term in sympy.Add.make_args(kv_part):
        coefficient, factor = term.as_independent(S.KV_IDX, as_Add=False)
        if factor != S.KV_IDX:
            return None
        a += coefficient
    return a, rest


@functools.lru_cache(maxsize=1024)
def _negated(e):
    return -e


def _threshold_form(rel, values):
    """(a, bound) when rel keeps kv_idx >= bound / a (a > 0) or kv_idx <= bound / -a (a < 0),
    a a nonzero int and bound free of kv_idx; else None."""
    form = _kv_linear(rel)
    if form is None:
        return None
    a, rest = form
    if not a.is_Integer:  # a parameter's value, or not a number at all
        a = a.xreplace({s: sympy.sympify(v) for s, v in values.items()})
    if not a.is_Integer or a == 0:
        return None
    a = int(a)
    return a, (_negated(rest) if a > 0 else rest)


@functools.lru_cache(maxsize=1024)
def row_wise(e) -> bool:
    """Whether every comparison in e is decided per row: free of kv_idx, or a threshold along
    it with a constant integer coefficient. Such a mask's block map costs O(rows); any other's
    costs O(tiles)."""
    if e is sympy.true or e is sympy.false:
        return True
    if isinstance(e, (sympy.And, sympy.Or, sympy.Xor, sympy.Not)):
        return all(row_wise(a) for a in e.args)
    form = _kv_linear(e)
    return not _reads_kv(e) or (form is not None and form[0].is_Integer and form[0] != 0)


@functools.lru_cache(maxsize=1024)
def _atoms(e) -> tuple:
    """The comparisons in e, each once."""
    if isinstance(e, (sympy.And, sympy.Or, sympy.Xor, sympy.Not)):
        return tuple(dict.fromkeys(atom for a in e.args for atom in _atoms(a)))
    return () if e is sympy.true or e is sympy.false else (e,)


@functools.lru_cache(maxsize=None)
def _keys(verdicts: tuple, certain: bool, device):
    """The keys of a fixed sequence of verdicts, made once per device; a numpy array for device None."""
    keys = [v * 2 + certain for v in verdicts]
    return np.array(keys, dtype=np.int8) if device is None else torch.tensor(keys, dtype=torch.int64, device=device)


def _clip(x, lo, hi):
    """x.clip(lo, hi) of a numpy array or a tensor; numpy's method costs more than its two ufuncs."""
    return np.minimum(np.maximum(x, lo), hi) if isinstance(x, np.ndarray) else x.clip(lo, hi)


def _floordiv(x, d):
    """floor(x / d) of integers, for numpy arrays and tensors alike."""
    return x if d == 1 else x // d


def _ceildiv(x, d):
    return x if d == 1 else (x + (d - 1)) // d


BlockMap.analyse = staticmethod(block_map_of_trace)
