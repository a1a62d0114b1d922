"""block_map(): analyse a traced mask into a BlockMap without evaluating it pair by pair.

Each comparison `a*kv_idx + R >= 0` whose kv_idx part is a plain multiple becomes, per
q-tile row, two thresholds along kv (O(rows) work). Other comparisons get per-tile
interval verdicts (O(tiles)). Verdicts combine through & | ~ ^ as row pieces. Tiles left
PARTIAL without certainty (two PARTIAL atoms meeting, an undecidable operation) are
settled by evaluating the mask on those tiles alone.
"""
from __future__ import annotations

import sympy
import torch

from maskc.analysis import dense
from maskc.analysis.blockmap import BlockMap
from maskc.analysis.classify import EMPTY, FULL, PARTIAL, classify_grid
from maskc.analysis.intervals import Interval, IntervalEvaluator, TensorSummaries, _Undecidable
from maskc.analysis._shapes import broadcast
from maskc.analysis.pieces import OPS, Pieces, compress
from maskc.trace import symbols as S
from maskc.trace.mods import as_mask_mod

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
    bm, bn = block_size = _block_size(block_size)
    for name, value in (("q_len", q_len), ("kv_len", kv_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}; pass the sequence length")
    traced = mm.traced
    free = traced.expr.free_symbols
    n_b = _dim(mm, free, S.B, B, "B", "batch size")
    n_h = _dim(mm, free, S.H, H, "H", "number of query heads")
    device = _normalise(torch.device(device) if device is not None else _tensor_device(traced.tensors))
    for i, t in enumerate(traced.tensors):
        if t.device != device:
            raise ValueError(f"mask_mod '{mm.__name__}' captured tensor #{i} on {t.device} but the block map is "
                             f"built on {device}; move the tensor or pass device={t.device}")
    ctx = _Analysis(traced, q_len, kv_len, bm, bn, n_b, n_h, device)
    pieces = ctx.pieces(traced.expr)
    pieces = ctx.settle(pieces.expand(broadcast(pieces.starts.shape[:3], (1, 1, ctx.n_q))))
    return BlockMap(pieces, q_len=q_len, kv_len=kv_len, block_size=block_size, mask_name=mm.__name__, mask_mod=mm)


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
    return tensors[0].device if tensors else torch.device("cpu")


class _Analysis:
    def __init__(self, traced, q_len, kv_len, bm, bn, n_b, n_h, device):
        self.traced = traced
        self.q_len, self.kv_len, self.bm, self.bn = q_len, kv_len, bm, bn
        self.n_b, self.n_h = n_b, n_h
        self.n_q, self.n_kv = -(-q_len // bm), -(-kv_len // bn)
        self.device = device
        self.values = traced.param_values()
        self.summaries = TensorSummaries(traced.tensors, device)
        ar = lambda n: torch.arange(n, device=device, dtype=torch.int64)  # noqa: E731
        q_lo = ar(self.n_q) * bm
        q_hi = torch.clamp(q_lo + bm, max=q_len) - 1
        kv_lo = ar(self.n_kv) * bn
        kv_hi = torch.clamp(kv_lo + bn, max=kv_len) - 1
        b = ar(n_b).view(-1, 1, 1, 1)
        h = ar(n_h).view(1, -1, 1, 1)
        self.row_frame = {
            S.B: Interval(b, b, True, True, frozenset([S.B])),
            S.H: Interval(h, h, True, True, frozenset([S.H])),
            S.Q_IDX: Interval(q_lo.view(1, 1, -1, 1), q_hi.view(1, 1, -1, 1), True, True, frozenset([S.Q_IDX])),
        }
        self.tile_frame = dict(self.row_frame)
        self.tile_frame[S.KV_IDX] = Interval(kv_lo.view(1, 1, 1, -1), kv_hi.view(1, 1, 1, -1), True, True,
                                             frozenset([S.KV_IDX]))

    def evaluator(self, frame) -> IntervalEvaluator:
        return IntervalEvaluator(frame, self.values, self.summaries, self.device)

    # -- boolean structure --------------------------------------------------------------------
    def pieces(self, e) -> Pieces:
        if e is sympy.true or e is sympy.false:
            return self._uniform(torch.tensor(FULL if e is sympy.true else EMPTY, dtype=torch.int8),
                                 torch.tensor(True))
        if isinstance(e, (sympy.And, sympy.Or, sympy.Xor)):
            op = OPS[type(e).__name__.lower()]
            parts = [self.pieces(a) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = out.combine(p, op)
            return out
        if isinstance(e, sympy.Not):
            return self.pieces(e.args[0]).negate()
        if S.KV_IDX not in e.free_symbols:
            return self._uniform(*classify_grid(e, self.evaluator(self.row_frame)))
        threshold = self._threshold(e)
        if threshold is not None:
            return threshold
        cls, certain = classify_grid(e, self.evaluator(self.tile_frame))
        shape = broadcast(cls.shape, (1, 1, self.n_q, self.n_kv))
        return Pieces.from_grid(cls.expand(shape), certain.expand(shape), shape[:3])

    def _uniform(self, cls, certain) -> Pieces:
        """One piece per row: a verdict that does not depend on kv_idx."""
        cls, certain = cls.to(self.device), certain.to(self.device)
        shape = broadcast(cls.shape, (1, 1, 1, 1))
        cls, certain = cls.expand(shape), certain.expand(shape)
        return Pieces(torch.zeros(shape, dtype=torch.int64, device=self.device), cls, certain, self.n_kv)

    # -- comparisons linear in kv_idx: thresholds per row ----------------------------------
    def _threshold(self, rel):
        if not isinstance(rel, sympy.GreaterThan):
            return None
        diff = rel.lhs - rel.rhs
        if not diff.is_integer:
            return None
        rest, kv_part = diff.as_independent(S.KV_IDX, as_Add=True)
        a = sympy.simplify(kv_part / S.KV_IDX).xreplace({k: sympy.sympify(v) for k, v in self.values.items()})
        if not a.is_Integer or a == 0 or S.KV_IDX in rest.free_symbols:
            return None
        try:
            r = self.evaluator(self.row_frame).run(rest)
        except _Undecidable:
            return None
        if r.lo.dtype != torch.int64:
            return None
        a = int(a)
        shape = broadcast(r.lo.shape, (1, 1, 1, 1))
        r_lo, r_hi = r.lo.expand(shape)[..., 0], r.hi.expand(shape)[..., 0]
        if a > 0:
            first_kept = _ceildiv(-r_hi, a)  # smallest kv kept by some q of the row
            first_all = _ceildiv(-r_lo, a)  # smallest kv kept by every q of the row
            nonempty_from = torch.where(first_kept > self.kv_len - 1, self.n_kv,
                                        torch.div(first_kept, self.bn, rounding_mode="floor").clamp(0, self.n_kv))
            full_from = torch.maximum(_ceildiv(first_all, self.bn).clamp(0, self.n_kv), nonempty_from)
            starts = torch.stack([torch.zeros_like(full_from), nonempty_from, full_from], -1)
            order = (EMPTY, PARTIAL, FULL)
        else:
            c = -a
            last_all = torch.div(r_lo, c, rounding_mode="floor")  # largest kv kept by every q
            last_kept = torch.div(r_hi, c, rounding_mode="floor")  # largest kv kept by some q
            full_to = torch.where(last_all >= self.kv_len - 1, self.n_kv,
                                  torch.div(last_all + 1, self.bn, rounding_mode="floor").clamp(0, self.n_kv))
            nonempty_to = (torch.div(last_kept, self.bn, rounding_mode="floor") + 1).clamp(0, self.n_kv)
            full_to = torch.minimum(full_to, nonempty_to)
            starts = torch.stack([torch.zeros_like(full_to), full_to, nonempty_to], -1)
            order = (FULL, PARTIAL, EMPTY)
        cls = torch.tensor(order, dtype=torch.int8, device=self.device).expand(starts.shape)
        certain = torch.full(starts.shape, r.tight, dtype=torch.bool, device=self.device)
        return compress(starts.contiguous(), cls, certain, self.n_kv)

    # -- dense settling of uncertain tiles ----------------------------------------------------
    def settle(self, pieces: Pieces) -> Pieces:
        if not bool(((pieces.cls == PARTIAL) & ~pieces.certain).any()):
            return pieces
        shape = (self.n_b, self.n_h, self.n_q, self.n_kv)
        cls, certain = pieces.expand(shape[:3]).to_grid()
        cls = cls.clone()
        todo = ((cls == PARTIAL) & ~certain).nonzero()
        per_chunk = max(1, _SETTLE_CHUNK // (self.bm * self.bn))
        for chunk in todo.split(per_chunk):
            cls[tuple(chunk.T)] = self._dense_verdict(chunk)
        return Pieces.from_grid(cls, torch.ones_like(cls, dtype=torch.bool), shape[:3])

    def _dense_verdict(self, tiles):
        b, h, i, j = (t.view(-1, 1, 1) for t in tiles.T)
        q = i * self.bm + torch.arange(self.bm, device=self.device).view(1, -1, 1)
        kv = j * self.bn + torch.arange(self.bn, device=self.device).view(1, 1, -1)
        valid = (q < self.q_len) & (kv < self.kv_len)
        env = dense.symbols_env(b, h, q.clamp(max=self.q_len - 1), kv.clamp(max=self.kv_len - 1))
        keep = dense.evaluate(self.traced.expr, env, self.traced.tensors, self.values)
        keep = keep.expand(valid.shape) & valid
        any_kept = keep.any(-1).any(-1)
        all_kept = (keep | ~valid).all(-1).all(-1)
        out = torch.full(any_kept.shape, PARTIAL, dtype=torch.int8, device=self.device)
        out[all_kept] = FULL
        out[~any_kept] = EMPTY
        return out


def _ceildiv(x, d):
    return -torch.div(-x, d, rounding_mode="floor")
