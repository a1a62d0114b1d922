"""Row-wise piecewise verdicts: per q-tile row, runs of kv tiles sharing one verdict.

`Pieces.starts[..., p]` is the first kv tile of piece p, sorted; piece p ends where piece
p + 1 starts (the last one at n_kv), so equal neighbouring starts make empty pieces, which
mean nothing. `key` packs each verdict with its certainty (`verdict * 2 + certain`) so that
combining two verdicts is one lookup in a table built from the rules of classify.py. A
band-shaped mask has a few pieces per row whatever the length, so building, combining and
storing it costs O(rows), not O(tiles).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from maskc.analysis._shapes import broadcast
from maskc.analysis.classify import FULL, PARTIAL, combine_and, combine_not, combine_or, combine_xor

N_KEYS = 6  # 3 verdicts × certain or not
UNSURE = PARTIAL * 2  # the key of a PARTIAL piece that dense evaluation must settle


def pack(cls: torch.Tensor, certain: torch.Tensor) -> torch.Tensor:
    """Verdict and certainty as one key; int64 so that it indexes the tables directly."""
    return cls.long() * 2 + certain


def unpack(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(verdict int8, certain bool) of keys."""
    return (key >> 1).to(torch.int8), (key & 1).bool()


@dataclass
class Pieces:
    starts: torch.Tensor  # int64 [B', H', n_q, P]
    key: torch.Tensor  # int64 [B', H', n_q, P]: verdict * 2 + certain
    n_kv: int

    @staticmethod
    def from_grid(cls: torch.Tensor, certain: torch.Tensor, rows_shape) -> "Pieces":
        """Compress a per-tile verdict [..., n_kv] into runs."""
        n_kv = cls.shape[-1]
        shape = (*rows_shape, n_kv)
        starts = torch.arange(n_kv, device=cls.device).expand(shape)
        return compress(starts, pack(cls, certain).expand(shape), n_kv)

    @property
    def verdict(self) -> torch.Tensor:
        """EMPTY, PARTIAL or FULL per piece (int64), without the certainty."""
        return self.key >> 1

    @functools.cached_property
    def ends(self) -> torch.Tensor:
        return F.pad(self.starts[..., 1:], (0, 1), value=self.n_kv)

    @functools.cached_property
    def live(self) -> torch.Tensor:
        """Which pieces cover at least one tile."""
        return self.starts < self.ends

    def to_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        tiles = torch.arange(self.n_kv, device=self.starts.device).expand(*self.starts.shape[:-1], self.n_kv)
        which = torch.searchsorted(self.starts.contiguous(), tiles.contiguous(), right=True) - 1
        return unpack(self.key.gather(-1, which))

    def unsure(self) -> bool:
        """Whether some nonempty piece is a PARTIAL verdict still to be settled."""
        return bool(((self.key == UNSURE) & self.live).any())

    def combine(self, other: "Pieces", op) -> "Pieces":
        shape = broadcast(self.starts.shape[:-1], other.starts.shape[:-1])
        a, b = self.expand(shape), other.expand(shape)
        starts, origin = torch.sort(torch.cat([a.starts, b.starts], dim=-1), dim=-1)
        # Counting each side's pieces merged so far finds the one covering each merged piece:
        # the last of them. Where starts tie the count can fall short, but only for merged
        # pieces that are empty.
        seen_a = (origin < a.starts.shape[-1]).cumsum(-1)
        in_a = (seen_a - 1).clamp_(min=0)
        in_b = (torch.arange(starts.shape[-1], device=starts.device) - seen_a).clamp_(min=0)
        pairs = a.key.gather(-1, in_a) * N_KEYS + b.key.gather(-1, in_b)
        return compress(starts, _lookup(_table(op, starts.device), pairs), self.n_kv)

    def negate(self) -> "Pieces":
        return Pieces(self.starts, _lookup(_table(combine_not, self.key.device), self.key), self.n_kv)

    def expand(self, rows_shape) -> "Pieces":
        shape = (*rows_shape, self.starts.shape[-1])
        return Pieces(self.starts.expand(shape), self.key.expand(shape), self.n_kv)

    def to(self, device) -> "Pieces":
        return Pieces(self.starts.to(device), self.key.to(device), self.n_kv)

    def run_tables(self, rows: int) -> tuple[torch.Tensor, int]:
        """The run tables of a BlockMap of these pieces in one int32 buffer, so that moving a map
        is one copy: [full offsets | partial offsets | full runs | partial runs], and the number
        of full runs. Each nonempty FULL or PARTIAL piece is a run: compress has merged neighbours."""
        device = self.starts.device
        sel = ((self.verdict == _verdicts(device)) & self.live).view(2, rows, -1)
        # on the host, nonzero + index_select takes half the time of a boolean index
        which = sel.view(2, -1).nonzero()[:, 1]
        tables = torch.empty(2 * (rows + 1 + len(which)), dtype=torch.int32, device=device)
        offsets = tables[:2 * (rows + 1)].view(2, rows + 1)
        offsets[:, 0] = 0
        # runs up to the end of each row: a running count over the rows laid end to end
        offsets[:, 1:] = sel.view(2, -1).cumsum(-1)[:, sel.shape[-1] - 1::sel.shape[-1]]
        bounds = torch.stack([self.starts, self.ends], dim=-1).to(torch.int32).view(-1, 2)
        torch.index_select(bounds, 0, which, out=tables[2 * (rows + 1):].view(-1, 2))
        return tables, int(offsets[0, -1])


OPS = {"and": combine_and, "or": combine_or, "xor": combine_xor}


@functools.lru_cache(maxsize=None)
def host_table(op) -> np.ndarray:
    """op applied to every key (combine_not) or pair of keys (indexed by key_a * N_KEYS + key_b),
    as int8 for the host's pieces (rows.py)."""
    keys = torch.arange(N_KEYS)
    if op is combine_not:
        return pack(*op(unpack(keys))).to(torch.int8).numpy()
    return pack(*op(unpack(keys.repeat_interleave(N_KEYS)), unpack(keys.repeat(N_KEYS)))).to(torch.int8).numpy()


@functools.lru_cache(maxsize=None)
def _table(op, device) -> torch.Tensor:
    return torch.from_numpy(host_table(op)).to(device, torch.int64)


@functools.lru_cache(maxsize=None)
def _verdicts(device) -> torch.Tensor:
    """FULL and PARTIAL along a leading dimension, made once per device."""
    return torch.tensor([FULL, PARTIAL], device=device).view(2, 1, 1, 1, 1)


def _lookup(table, index):
    # index_select is several times faster than table[index] on the host for small tables
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def compress(starts, key, n_kv) -> Pieces:
    """Drop the empty pieces and merge neighbours with the same key: the fewest pieces per row."""
    starts = starts.contiguous()
    # Among pieces with one start all but the last are empty: the last one's key holds there.
    key = key.gather(-1, torch.searchsorted(starts, starts, right=True) - 1)
    opens = torch.ones_like(key, dtype=torch.bool)
    opens[..., 1:] = key[..., 1:] != key[..., :-1]
    opens &= starts < n_kv
    # Openers move to the front of their row in order; the rest land in a spare last column.
    slot = opens.cumsum(-1)
    count = int(slot[..., -1].max())
    slot = slot.sub_(1).masked_fill_(~opens, count)
    shape = (*starts.shape[:-1], count + 1)
    kept_starts = starts.new_full(shape, n_kv).scatter_(-1, slot, starts)[..., :count]
    kept_key = key.new_zeros(shape).scatter_(-1, slot, key)[..., :count]
    return Pieces(kept_starts, kept_key, n_kv)
