"""Row-wise masks on the host: every comparison a threshold along kv_idx, or free of it.

Causal, sliding window, prefix-LM and their compositions cut each q-tile row in at most two
places per threshold (Cuts). The whole expression is evaluated once on the pieces between
all the cuts of a row (row_pieces) instead of combined pair by pair like Pieces, and those
pieces become run tables directly (HostPieces.run_tables). numpy rather than torch: the build
is a few dozen steps on arrays of a few thousand, where a numpy step costs about 1 us and a
torch one 5-10. The steps run on the rows laid end to end, since a numpy step along a short
last axis costs per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import sympy
import torch

from maskc.analysis._shapes import broadcast
from maskc.analysis.classify import EMPTY, FULL, PARTIAL, combine_not
from maskc.analysis.pieces import N_KEYS, OPS, UNSURE, Pieces, host_table


class Cuts(NamedTuple):
    """A threshold along kv in every row: keys[0] before tile `first`, keys[1] from there up to
    tile `second`, keys[2] from there on (first <= second). numpy arrays on the host, else tensors."""
    first: object  # [B', H', n_q]
    second: object
    keys: object  # [3]

    def key_at(self, tiles: np.ndarray) -> np.ndarray:
        """The key at kv tiles [B', H', n_q, P]: the one after as many cuts as lie at or before."""
        flat = tiles.reshape(-1)
        passed = [flat >= _per_tile(cut, tiles.shape) for cut in (self.first, self.second)]
        return self.keys.take(passed[0].view(np.int8) + passed[1]).reshape(tiles.shape)


@dataclass
class HostPieces:
    """The pieces of a row-wise mask on the host, as row_pieces makes them: not compressed, and
    only turned into run tables, or into Pieces where some need settling."""
    starts: np.ndarray  # int32 [B', H', n_q, P]: sorted along P, from 0 up to n_kv
    # int8 [B', H', n_q, P]: verdict * 2 + certain on the tile at the start (the last tile from
    # n_kv on), so pieces that share a start share a key, and which of them is the nonempty one
    # never needs finding; but the last piece closes the row: it starts at n_kv and is EMPTY
    key: np.ndarray
    n_kv: int

    def unsure(self) -> bool:
        """Whether some piece is a PARTIAL verdict still to be settled."""
        return bool((self.key == UNSURE).any())

    def expand(self, rows_shape) -> "HostPieces":
        shape = (*rows_shape, self.starts.shape[-1])
        return HostPieces(np.broadcast_to(self.starts, shape), np.broadcast_to(self.key, shape), self.n_kv)

    def to(self, device) -> Pieces:
        """The same pieces as Pieces on `device`, for settling."""
        return Pieces(*(torch.tensor(a, dtype=torch.int64, device=device) for a in (self.starts, self.key)), self.n_kv)

    def run_tables(self, rows: int) -> tuple[torch.Tensor, int]:
        """The run tables of a BlockMap of these pieces, in one int32 buffer: [full offsets |
        partial offsets | full runs | partial runs], and the number of full runs. Neighbouring
        pieces of one verdict make one run."""
        starts, verdict = self.starts.reshape(-1), (self.key >> 1).reshape(-1)
        # every change of verdict opens a run of the new verdict that lasts up to the next change:
        # rows end in EMPTY, so no run reaches into the next row, and the last change is to EMPTY
        at = np.flatnonzero(verdict[1:] != verdict[:-1]) + 1
        if verdict[0] != EMPTY:
            at = np.concatenate([[0], at])
        # take with indices: numpy's boolean indexing and fancy assignment cost several times more
        new, bound, row = verdict.take(at), starts.take(at), at // self.starts.shape[-1]
        opens = [np.flatnonzero(new == v) for v in (FULL, PARTIAL)]
        tables = np.empty(2 * (rows + 1 + len(opens[0]) + len(opens[1])), dtype=np.int32)
        offsets = tables[:2 * (rows + 1)].reshape(2, rows + 1)
        offsets[:, 0] = 0
        for o, offs, runs in zip(opens, offsets, np.split(tables[2 * (rows + 1):], [2 * len(opens[0])])):
            np.cumsum(np.bincount(row.take(o), minlength=rows), out=offs[1:])
            bound.take(np.stack([o, o + 1], -1), out=runs.reshape(-1, 2))
        return torch.from_numpy(tables), len(opens[0])


def row_pieces(expr, leaves: dict, n_q: int, n_kv: int) -> HostPieces:
    """The pieces of a row-wise expr, from the Cuts of its thresholds and the keys per row
    ([B', H', n_q, 1]) of its comparisons free of kv_idx, in `leaves`."""
    cuts = [leaf for leaf in leaves.values() if isinstance(leaf, Cuts)]
    per_row = [leaf.shape[:3] for leaf in leaves.values() if not isinstance(leaf, Cuts)]
    rows = broadcast((1, 1, n_q), *per_row, *(c.first.shape for c in cuts), *(c.second.shape for c in cuts))
    # 0, the cuts, and n_kv for the piece that closes the row
    starts = np.empty((*rows, 2 + 2 * len(cuts)), dtype=np.int32)
    starts[..., 0], starts[..., -1] = 0, n_kv
    for i, c in enumerate(cuts):
        starts[..., 2 * i + 1], starts[..., 2 * i + 2] = c.first, c.second
    if len(cuts) > 1:  # one threshold's cuts are in order already
        starts.sort(-1)
    # pieces from n_kv on take the last tile's key: they never make a run of their own
    key = _key(expr, leaves, np.minimum(starts, n_kv - 1), {})
    key = np.full(starts.shape, key, dtype=np.int8) if np.ndim(key) == 0 else key
    key[..., -1] = EMPTY * 2 + 1
    return HostPieces(starts, key, n_kv)


def _key(e, leaves, tiles, memo: dict) -> np.ndarray | int:
    """The key of e at kv tiles [B', H', n_q, P]: a new array, or a number for all. `memo`
    holds each subexpression's key by identity: a torch.where nest shares its subexpressions."""
    found = memo.get(id(e))
    if found is None:
        found = memo[id(e)] = (e, _key_of(e, leaves, tiles, memo))
    return found[1]


def _key_of(e, leaves, tiles, memo) -> np.ndarray | int:
    if e is sympy.true or e is sympy.false:
        return (FULL if e is sympy.true else EMPTY) * 2 + 1
    if isinstance(e, (sympy.And, sympy.Or, sympy.Xor)):
        table = host_table(OPS[type(e).__name__.lower()])
        keys = [_key(a, leaves, tiles, memo) for a in e.args]
        out = keys[0]
        for k in keys[1:]:
            out = table.take(out * N_KEYS + k)
        return out
    if isinstance(e, sympy.Not):
        return host_table(combine_not).take(_key(e.args[0], leaves, tiles, memo))
    leaf = leaves[e]
    if isinstance(leaf, Cuts):
        return leaf.key_at(tiles)
    return _per_tile(leaf[..., 0], tiles.shape).reshape(tiles.shape)


def _per_tile(x: np.ndarray, shape) -> np.ndarray:
    """x [B', H', n_q] (or broadcastable) at each tile of its row in tiles of `shape`, flat: steps
    on the rows laid end to end cost less than steps that broadcast along a short last axis."""
    return np.repeat(x if x.shape == shape[:-1] else np.broadcast_to(x, shape[:-1]), shape[-1])
