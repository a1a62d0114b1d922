"""Row-wise piecewise verdicts: per q-tile row, runs of kv tiles sharing one verdict.

`Pieces.starts[..., p]` is the first kv tile of piece p (sorted; padding pieces start at
n_kv and are empty); `cls` and `certain` are its verdict. A band-shaped mask has a few
pieces per row whatever the length, so building, combining and storing it costs
O(rows), not O(tiles).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from maskc.analysis._shapes import broadcast
from maskc.analysis.classify import combine_and, combine_not, combine_or, combine_xor


@dataclass
class Pieces:
    starts: torch.Tensor  # int64 [B', H', n_q, P]
    cls: torch.Tensor  # int8  [B', H', n_q, P]
    certain: torch.Tensor  # bool [B', H', n_q, P]
    n_kv: int

    @staticmethod
    def from_grid(cls: torch.Tensor, certain: torch.Tensor, rows_shape) -> "Pieces":
        """Compress a per-tile verdict [..., n_kv] into runs."""
        n_kv = cls.shape[-1]
        shape = (*rows_shape, n_kv)
        cls, certain = cls.expand(shape), certain.expand(shape)
        starts = torch.arange(n_kv, device=cls.device).expand(shape)
        return compress(starts, cls, certain, n_kv)

    def to_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = torch.arange(self.n_kv, device=self.starts.device).expand(*self.starts.shape[:-1], self.n_kv)
        which = torch.searchsorted(self.starts.contiguous(), tiles.contiguous(), right=True) - 1
        return self.cls.gather(-1, which), self.certain.gather(-1, which)

    def ends(self) -> torch.Tensor:
        pad = torch.full_like(self.starts[..., :1], self.n_kv)
        return torch.cat([self.starts[..., 1:], pad], dim=-1)

    def combine(self, other: "Pieces", op) -> "Pieces":
        shape = broadcast(self.starts.shape[:-1], other.starts.shape[:-1])
        a, b = self.expand(shape), other.expand(shape)
        starts = torch.sort(torch.cat([a.starts, b.starts], dim=-1), dim=-1).values
        va, vb = a.at(starts), b.at(starts)
        cls, certain = op(va, vb)
        return compress(starts, cls, certain, self.n_kv)

    def negate(self) -> "Pieces":
        cls, certain = combine_not((self.cls, self.certain))
        return Pieces(self.starts, cls, certain, self.n_kv)

    def expand(self, rows_shape) -> "Pieces":
        shape = (*rows_shape, self.starts.shape[-1])
        return Pieces(self.starts.expand(shape), self.cls.expand(shape), self.certain.expand(shape), self.n_kv)

    def at(self, positions: torch.Tensor):
        """The verdict covering each kv tile in `positions` (same leading shape)."""
        which = torch.searchsorted(self.starts.contiguous(), positions.contiguous(), right=True) - 1
        which = which.clamp(min=0)
        return self.cls.gather(-1, which), self.certain.gather(-1, which)


OPS = {"and": combine_and, "or": combine_or, "xor": combine_xor}



def compress(starts, cls, certain, n_kv) -> Pieces:
    """Merge neighbouring pieces with the same verdict and drop the empty ones."""
    key = cls.to(torch.int16) * 2 + certain.to(torch.int16)
    # Among pieces with the same start all but the last are empty: the last one covers it.
    starts = starts.contiguous()
    last = torch.searchsorted(starts, starts, right=True) - 1
    key = key.gather(-1, last)
    changed = torch.ones_like(key, dtype=torch.bool)
    changed[..., 1:] = key[..., 1:] != key[..., :-1]
    boundary = changed & (starts < n_kv)
    count = int(boundary.sum(-1).max()) if boundary.numel() else 1
    count = max(count, 1)
    order = torch.sort(torch.where(boundary, starts, n_kv), dim=-1, stable=True)
    keep_starts = order.values[..., :count]
    kept_key = key.gather(-1, order.indices[..., :count])
    keep_starts = keep_starts.clone()
    keep_starts[..., 0] = 0  # position 0 is always a boundary; this only guards n_kv == 0
    return Pieces(keep_starts.contiguous(), (kept_key // 2).to(torch.int8), (kept_key % 2).to(torch.bool), n_kv)
