"""BlockMap: which tiles of the attention matrix are FULL, PARTIAL or EMPTY.

Stored as runs: for every (b, h, q-tile) row, the [start, end) ranges of consecutive kv
tiles that are FULL, and those that are PARTIAL, in CSR form (`*_offsets[row]` ..
`*_offsets[row + 1]` index `*_runs`). A causal map is one FULL run and one PARTIAL run per
row whatever the length. When the mask ignores b (or h) that dimension is stored once. The
four tables are views of one int32 buffer, so moving a map to a GPU is one copy.
"""
from __future__ import annotations

import functools
import itertools
import weakref

import torch

from maskc.analysis import dense
from maskc.analysis.classify import EMPTY, FULL, PARTIAL
from maskc.analysis.pieces import Pieces
from maskc.analysis.rows import HostPieces
from maskc.errors import MaskcError
from maskc.trace import dag
from maskc.trace import symbols as S
from maskc.trace.mods import as_mask_mod

_TABLES = ("_buffer", "full_offsets", "full_runs", "partial_offsets", "partial_runs")
# Every map by its serial number, for maskc's torch operators, which name a call's map by its
# handle (that number as a tensor): a map is found by its handle while it lives.
_BY_SERIAL: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SERIAL = itertools.count()
_GLYPHS = {EMPTY: "·", PARTIAL: "░", FULL: "█"}
# The last line of every text picture: the glyphs mean nothing to a reader without it.
_LEGEND = (f"{_GLYPHS[FULL]} FULL: no mask code  {_GLYPHS[PARTIAL]} PARTIAL: mask evaluated  "
           f"{_GLYPHS[EMPTY]} EMPTY: skipped")
_PICTURE_MAX = 64
# Tiles of a map whose derived maps are computed on the host (_work_device): on the dev CPU a
# causal map of 2^22 tiles took 0.15 s to coarsen and 0.32 s to transpose, about the GPU's
# first-use cost; 2^21 stays well below it.
_HOST_CELLS = 1 << 21
# Pairs coarsens_exactly evaluates the mask on at a time, as the analysis settles tiles.
_DENSE_PAIRS = 1 << 22


def _cut_blocks(grid, block_size, tile_size, q_len: int, kv_len: int):
    """`grid` of blocks of `block_size` as a grid of tiles of `tile_size` (each side dividing its
    block's), each tile keeping its block's status, as FlexAttention's kernels read a block larger
    than their tiles: O(tiles), never O(block size)."""
    for dim, length, block, tile in ((2, q_len, block_size[0], tile_size[0]), (3, kv_len, block_size[1], tile_size[1])):
        if tile != block:
            tiles = torch.arange(-(-length // tile), device=grid.device)
            grid = grid.index_select(dim, tiles * tile // block)
    return grid


class BlockMap:
    """The tile classification of one mask at given lengths and tile sizes.

    >>> bm = maskc.block_map(maskc.masks.causal, q_len=1024, kv_len=1024, block_size=(128, 128))
    >>> bm.num_full, bm.num_partial, bm.num_empty
    (28, 8, 28)
    >>> print(bm)          # picture of the tiles
    >>> bm.to_dense()      # int8 [B', H', q_tiles, kv_tiles]: 0 EMPTY, 1 PARTIAL, 2 FULL
    """

    # The analysis of a mask into a map (maskc.analysis.build.block_map_of_trace), which a listed
    # map asks to check its tiles (agrees_with_mask). build builds on this module and installs it
    # here when imported; maskc/analysis/__init__.py imports build.
    analyse = None

    def __init__(self, pieces: Pieces | HostPieces, *, q_len: int, kv_len: int, block_size: tuple[int, int],
                 mask_name: str = "mask", mask_mod=None, traced=None, device=None):
        self.q_len, self.kv_len = q_len, kv_len
        self.block_size = tuple(block_size)
        self.mask_name = mask_name
        self.mask_mod = mask_mod
        # What the tiles were classified from, for compiled_attention to refuse the map for
        # anything else: the trace (signature, parameter values, captured tensors, which it
        # keeps alive, so their ids stay theirs) and each captured tensor's stamp then (Traced.stamps:
        # version and data pointer), with the storages held so that the pointers stay theirs too.
        self.traced = traced
        self.tensor_stamps = traced.stamps() if traced is not None else ()
        self._storages = traced.storages() if traced is not None else ()
        self.B, self.H, self.n_q = pieces.starts.shape[:3]
        self.n_kv = pieces.n_kv
        buffer, self._n_full = pieces.run_tables(self.B * self.H * self.n_q)
        self._buffer = buffer if device is None else buffer.to(device)
        self._set_views()
        self._coarse: dict = {}  # coarsened(q_factor, kv_factor) of this map, built once
        # Whether the tiles were listed rather than analysed from the mask (from_flex_tiles), so
        # may disagree with it (agrees_with_mask); coarsens_exactly's answers by factors.
        self.listed = False
        self._exact: dict = {}
        self._register()

    def _register(self) -> None:
        serial = next(_SERIAL)
        # A tensor, not a string: a compiled graph takes it as an input, so a new map of the same
        # shape runs the same graph, where a string would be a constant the graph is guarded on.
        self.handle = torch.tensor(serial, dtype=torch.int64, device="cpu")  # (not the default device: meta, cuda)
        _BY_SERIAL[serial] = self

    @staticmethod
    def of_handle(handle: torch.Tensor) -> "BlockMap | None":
        """The map whose `handle` this is, or None when it no longer lives."""
        return _BY_SERIAL.get(int(handle))

    def _set_views(self):
        self.full_offsets, self.partial_offsets, self.full_runs, self.partial_runs = self._views(self._buffer)

    def _views(self, buffer):
        """(full offsets, partial offsets, full runs, partial runs) as views of a buffer laid out
        [full offsets | partial offsets | full runs | partial runs]."""
        n = self.B * self.H * self.n_q + 1
        runs = buffer[2 * n:].view(-1, 2)
        return buffer[:n], buffer[n:2 * n], runs[:self._n_full], runs[self._n_full:]

    # -- counts -----------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.H, self.n_q, self.n_kv)

    @functools.cached_property
    def num_full(self) -> int:
        return _tiles(self.full_runs)

    @functools.cached_property
    def num_partial(self) -> int:
        return _tiles(self.partial_runs)

    def kept_per_row(self) -> torch.Tensor:
        """The kept (FULL or PARTIAL) tiles of each of the B·H·n_q rows of tiles, on the map's device.

        >>> maskc.block_map(maskc.masks.causal, 512, 512).kept_per_row().tolist()
        [1, 2, 3, 4]
        """
        kept = torch.zeros(self.B * self.H * self.n_q, dtype=torch.int64, device=self.device)
        for offsets, runs in ((self.full_offsets, self.full_runs), (self.partial_offsets, self.partial_runs)):
            ends = torch.nn.functional.pad((runs[:, 1] - runs[:, 0]).long().cumsum(0), (1, 0))
            kept += ends[offsets[1:].long()] - ends[offsets[:-1].long()]
        return kept

    @property
    def num_empty(self) -> int:
        return self.B * self.H * self.n_q * self.n_kv - self.num_full - self.num_partial

    @property
    def sparsity(self) -> float:
        """Fraction of tiles skipped (EMPTY)."""
        total = self.B * self.H * self.n_q * self.n_kv
        return self.num_empty / total if total else 0.0

    def nbytes(self) -> int:
        """Bytes of the run tables this map holds, with those of the maps derived from it so far
        (transposed, coarsened); the captured tensors it keeps alive are not counted."""
        derived = [*self._coarse.values(), *([self.__dict__["transposed"]] if "transposed" in self.__dict__ else [])]
        return self._buffer.nbytes + sum(m.nbytes() for m in derived)

    @property
    def device(self) -> torch.device:
        return self.full_offsets.device

    # -- other forms ------------------------------------------------------------------------
    def to_dense(self, device=None) -> torch.Tensor:
        """int8 tensor [B', H', q_tiles, kv_tiles]: 0 EMPTY, 1 PARTIAL, 2 FULL, on `device`
        (default: the map's)."""
        device = self.device if device is None else torch.device(device)
        rows = self.B * self.H * self.n_q
        # one copy where the device differs
        full_offsets, partial_offsets, full_runs, partial_runs = self._views(self._buffer.to(device))
        grid = torch.zeros(rows, self.n_kv + 1, dtype=torch.int32, device=device)
        for offsets, runs, value in ((full_offsets, full_runs, FULL), (partial_offsets, partial_runs, PARTIAL)):
            row = torch.repeat_interleave(torch.arange(rows, device=device), offsets.diff().long())
            ones = torch.full((len(row),), value, dtype=torch.int32, device=device)
            grid.index_put_((row, runs[:, 0].long()), ones, accumulate=True)
            grid.index_put_((row, runs[:, 1].long()), -ones, accumulate=True)
        return grid.cumsum(-1)[:, : self.n_kv].to(torch.int8).reshape(self.shape)

    @functools.cached_property
    def transposed(self) -> "BlockMap":
        """The map of kv-tile rows over q tiles, for the backward pass's dK/dV loop."""
        dense = self.to_dense(self._work_device()).transpose(-1, -2)
        pieces = Pieces.from_grid(dense, torch.ones_like(dense, dtype=torch.bool), dense.shape[:3])
        return BlockMap(pieces, q_len=self.kv_len, kv_len=self.q_len, block_size=self.block_size[::-1],
                        mask_name=f"{self.mask_name}ᵀ", device=self.device)

    def _work_device(self) -> torch.device:
        """Where the maps derived from this one (transposed, coarsened) are computed: on the
        host up to _HOST_CELLS tiles, then moved in one copy. On a GPU each torch op's first
        use in a process loads its kernel: densifying a 64×64-tile map there took 0.2-0.3 s of
        a warm process's first call on an H200 (benchmarks/compile_latency.py)."""
        cells = self.B * self.H * self.n_q * self.n_kv
        return torch.device("cpu") if cells <= _HOST_CELLS else self.device

    def to_flex_block_mask(self, B: int | None = None, H: int | None = None, *, separate_full_blocks: bool = True):
        """The same tiles as a torch BlockMask for flex_attention (B, H broadcast to the given sizes).
        Without separate_full_blocks every kept tile is listed as one the mask runs on, as
        torch's create_block_mask(separate_full_blocks=False) lists them."""
        from torch.nn.attention.flex_attention import BlockMask

        dense = self.to_dense()
        if B is not None or H is not None:
            dense = dense.expand(B or self.B, H or self.H, self.n_q, self.n_kv)
        if separate_full_blocks:
            kv_num, kv_idx = _flex_lists(dense == PARTIAL)
            full_num, full_idx = _flex_lists(dense == FULL)
        else:
            (kv_num, kv_idx), full_num, full_idx = _flex_lists(dense != EMPTY), None, None
        # the MaskMod itself (callable as the function): under torch.compile maskc names it by its handle
        return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=self.block_size,
                                        mask_mod=self.mask_mod, seq_lengths=(self.q_len, self.kv_len))

    @classmethod
    def from_flex_block_mask(cls, block_mask, tile_size: tuple[int, int] | None = None) -> "BlockMap":
        """The tiles of a torch BlockMask as a BlockMap that compiled_attention runs; O(tiles) work.

        The tiles are taken as the BlockMask lists them, which is how flex_attention reads them:
        a tile it leaves out is skipped, a full tile runs without the mask, a partial one with
        it. Its mask_mod is traced by maskc and recorded as what the map was built from, so
        compiled_attention accepts the map with that mask (or runs it when given no mask_mod).
        With `tile_size` (q, kv), each side dividing the block's, every block is cut into tiles
        of that size, each with its block's status: the tiles a map that drives the kernels
        takes (maskc.runtime.tiles.kernel_tiles_of).

        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 1024, 1024, device="cpu")
        >>> m = maskc.BlockMap.from_flex_block_mask(bm)
        >>> m.num_full, m.num_partial
        (28, 8)
        """
        return cls.from_flex_tiles(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                                   block_mask.full_kv_indices, seq_lengths=block_mask.seq_lengths,
                                   block_size=block_mask.BLOCK_SIZE, mask_mod=block_mask.mask_mod,
                                   tile_size=tile_size)

    @classmethod
    def from_flex_tiles(cls, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, *, seq_lengths,
                        block_size, mask_mod, tile_size: tuple[int, int] | None = None) -> "BlockMap":
        """from_flex_block_mask from a BlockMask's parts (maskc's torch operator gets them as
        tensors, so that a new BlockMask of the same shape runs the same compiled graph)."""
        num = kv_num_blocks
        if num.dim() != 3:
            raise ValueError(f"block_mask must have kv_num_blocks of shape [B, H, q_blocks], got "
                             f"{tuple(num.shape)}; give its tensors batch and head dimensions ([None, None])")
        q_len, kv_len = (int(n) for n in seq_lengths)
        block_size = (block_size, block_size) if isinstance(block_size, int) else tuple(int(b) for b in block_size)
        tile_size = block_size if tile_size is None else tuple(tile_size)
        if any(block % tile for block, tile in zip(block_size, tile_size)):
            raise ValueError(f"tile_size {tile_size} must divide the blocks' BLOCK_SIZE {block_size} on each side; "
                             f"take it from maskc.runtime.tiles.kernel_tiles_of(BLOCK_SIZE)")
        n_q, n_kv = -(-q_len // block_size[0]), -(-kv_len // block_size[1])
        if num.shape[-1] < n_q:
            raise ValueError(f"block_mask has {num.shape[-1]} rows of q blocks, but its seq_lengths "
                             f"{(q_len, kv_len)} with BLOCK_SIZE={block_size} make {n_q}: a slice "
                             f"(block_mask[:, :, i]) keeps the lengths of the mask it was cut from; set them to "
                             f"the call's (block_mask.seq_lengths = (q_len, kv_len)), or build it with "
                             f"create_block_mask for its lengths")
        if num.shape[-1] > n_q:
            # made for more queries (torch's decoding idiom: a mask of the whole cache, seq_lengths set
            # to (1, KV_LEN)): its first rows serve, as FlexAttention's kernel reads them
            num, kv_indices = num[..., :n_q], kv_indices[..., :n_q, :]
            if full_kv_num_blocks is not None:
                full_kv_num_blocks, full_kv_indices = full_kv_num_blocks[..., :n_q], full_kv_indices[..., :n_q, :]
        grid = _flex_grid(num, kv_indices, n_kv, "kv_indices")
        if full_kv_num_blocks is not None:
            full = _flex_grid(full_kv_num_blocks, full_kv_indices, n_kv, "full_kv_indices")
            if (grid & full).any():
                raise ValueError("block_mask lists a kv block both in kv_indices and in full_kv_indices, which "
                                 "flex_attention would attend twice; list each block once")
            grid = torch.where(full, FULL, grid * PARTIAL)
        grid = _cut_blocks(grid.to(torch.int8), block_size, tile_size, q_len, kv_len)
        pieces = Pieces.from_grid(grid, torch.ones_like(grid, dtype=torch.bool), grid.shape[:3])
        mask = as_mask_mod(mask_mod)
        listed = cls(pieces, q_len=q_len, kv_len=kv_len, block_size=tile_size, mask_name=mask.__name__,
                     mask_mod=mask, traced=mask.traced)
        listed.listed = True
        return listed

    @functools.cached_property
    def agrees_with_mask(self) -> bool:
        """Whether the mask keeps no pair of an EMPTY tile and every pair of a FULL one, so that a
        kernel may evaluate it on any tile and read the map at any coarser tiles. A map analysed
        from its mask does (the analysis is sound); a listed one (from_flex_tiles) need not: a
        hand-made BlockMask may leave out tiles its mask_mod keeps, or list as full a tile it
        masks, and FlexAttention attends exactly the tiles it lists."""
        if not self.listed:
            return True
        # The mask's own map at these tiles (O(tiles) for the standard masks) clears the tiles it
        # is sure of; the mask is evaluated only on the EMPTY and FULL tiles it leaves unsure,
        # not on every pair of every such tile (O(L²)).
        analysed = BlockMap.analyse(self.mask_mod, self.traced, self.q_len, self.kv_len, block_size=self.block_size,
                                    B=self.B, H=self.H, settle=False).to_dense()
        fine = self.to_dense(analysed.device)
        unsure = ((fine == EMPTY) & (analysed != EMPTY)) | ((fine == FULL) & (analysed != FULL))
        return self._agrees_on(unsure.nonzero(), fine)

    def coarsens_exactly(self, block_m: int, block_n: int) -> bool:
        """Whether a kernel of block_m × block_n tiles reads this map as its tiles say (for_tiles).
        A map tile as large as the kernel's, or larger, always is; a coarser kernel tile of mixed
        verdicts evaluates the mask on all its pairs, which is exact only where the mask agrees
        with the EMPTY and FULL tiles it covers (agrees_with_mask). Where it is not, the kernel's
        tiles must be no larger than the map's (maskc.runtime.tiles.choose cuts them so).
        Decided once per size by evaluating the mask on those tiles alone: no more pairs than
        the kernel evaluates it on."""
        factors = (max(1, block_m // self.block_size[0]), max(1, block_n // self.block_size[1]))
        if not self.listed or factors == (1, 1):
            return True
        exact = self._exact.get(factors)
        if exact is None:
            exact = self._exact[factors] = self._mixes_agreeing(*factors)
        return exact

    def _mixes_agreeing(self, q_factor: int, kv_factor: int) -> bool:
        """Whether the mask agrees with the EMPTY and FULL tiles that lie in PARTIAL tiles of
        coarsened(q_factor, kv_factor)."""
        # where the captured tensors are (a CPU scalar serves any device, as in the analysis)
        device = next((t.device for t in self.traced.tensors if t.dim() or t.device.type != "cpu"), self.device)
        fine = self.to_dense(device)
        coarse = self.coarsened(q_factor, kv_factor).to_dense(device)
        coarse = coarse.repeat_interleave(q_factor, 2)[:, :, :self.n_q].repeat_interleave(kv_factor, 3)[..., :self.n_kv]
        return self._agrees_on((((fine == EMPTY) | (fine == FULL)) & (coarse == PARTIAL)).nonzero(), fine)

    def _agrees_on(self, tiles: torch.Tensor, fine: torch.Tensor) -> bool:
        """Whether the mask keeps no pair of each EMPTY tile and every pair of each FULL one among
        `tiles` (rows of (b, h, q tile, kv tile) into `fine`, this map's to_dense()), by
        evaluating it on their pairs, a chunk at a time, on fine's device."""
        device = fine.device
        bm, bn = self.block_size
        values = self.traced.param_values()
        for chunk in tiles.split(max(1, _DENSE_PAIRS // (bm * bn))):
            b, h, i, j = (t.view(-1, 1, 1) for t in chunk.T)
            q = i * bm + torch.arange(bm, device=device).view(1, -1, 1)
            kv = j * bn + torch.arange(bn, device=device).view(1, 1, -1)
            valid = (q < self.q_len) & (kv < self.kv_len)
            env = dense.symbols_env(b, h, q.clamp(max=self.q_len - 1), kv.clamp(max=self.kv_len - 1))
            keep = dense.evaluate(self.traced.expr, env, self.traced.tensors, values).expand(valid.shape) & valid
            full = fine[tuple(chunk.T)].view(-1, 1, 1) == FULL
            if bool(torch.where(full, valid & ~keep, keep).any()):
                return False
        return True

    def for_tiles(self, block_m: int, block_n: int) -> tuple["BlockMap", int, int]:
        """This map as a kernel with block_m × block_n tiles reads it: (map, q multiple, kv
        multiple). A map tile spanning several kernel tiles is read as it is, the kernel scaling
        its runs by the multiples (Inductor's SPARSE_Q/KV_BLOCK_SIZE); where a kernel tile spans
        several map tiles, the map is coarsened (no analysis of the mask again). Tile sizes are
        powers of two, so one always divides the other. A listed map whose coarsening would
        change which pairs are attended (coarsens_exactly) is refused."""
        m, n = self.block_size
        for mine, theirs in ((m, block_m), (n, block_n)):
            if mine % theirs and theirs % mine:
                raise ValueError(f"block_map tiles {self.block_size} cannot drive {block_m}×{block_n} kernel tiles: "
                                 f"one must be a multiple of the other; build the map with block_size=(64, 64)")
        if not self.coarsens_exactly(block_m, block_n):
            raise MaskcError(f"a listed block_map is read at coarser kernel tiles only where that changes no pair, "
                             f"got {block_m}×{block_n} kernel tiles over its {self.block_size} ones, which would "
                             f"cover EMPTY or FULL tiles that mask_mod '{self.mask_name}' disagrees with beside "
                             f"others and let it decide their pairs; read it at kernel tiles of at most "
                             f"{self.block_size} (maskc.runtime.tiles.choose cuts them so)")
        coarse = self.coarsened(max(1, block_m // m), max(1, block_n // n))
        return coarse, max(1, m // block_m), max(1, n // block_n)

    def coarsened(self, q_factor: int, kv_factor: int) -> "BlockMap":
        """The map of tiles q_factor × kv_factor times larger: FULL where every tile it covers is,
        EMPTY where every one is, else PARTIAL (exactly what an analysis at that size finds
        when this map is exact)."""
        if (q_factor, kv_factor) == (1, 1):
            return self
        found = self._coarse.get((q_factor, kv_factor))
        if found is not None:
            return found
        dense = self.to_dense(self._work_device())
        pad = (0, -self.n_kv % kv_factor, 0, -self.n_q % q_factor)
        shape = (self.B, self.H, -(-self.n_q // q_factor), q_factor, -(-self.n_kv // kv_factor), kv_factor)
        # tiles past the matrix's end count as FULL for "all FULL" and EMPTY for "any kept"
        lo = torch.nn.functional.pad(dense, pad, value=FULL).view(shape).amin(dim=(3, 5))
        hi = torch.nn.functional.pad(dense, pad, value=EMPTY).view(shape).amax(dim=(3, 5))
        grid = torch.where(hi == EMPTY, EMPTY, torch.where(lo == FULL, FULL, PARTIAL)).to(torch.int8)
        pieces = Pieces.from_grid(grid, torch.ones_like(grid, dtype=torch.bool), grid.shape[:3])
        coarse = BlockMap(pieces, q_len=self.q_len, kv_len=self.kv_len,
                          block_size=(self.block_size[0] * q_factor, self.block_size[1] * kv_factor),
                          mask_name=self.mask_name, mask_mod=self.mask_mod, traced=self.traced, device=self.device)
        # built from this map, so from these values, and listed where it is
        coarse.tensor_stamps, coarse._storages, coarse.listed = self.tensor_stamps, self._storages, self.listed
        self._coarse[(q_factor, kv_factor)] = coarse
        return coarse

    def kernel_rows(self, batch: int, heads: int) -> tuple[int, int]:
        """The row strides (row_strides) for a launch of batch × heads programs, after refusing
        a map whose rows cannot serve them. Where a caller's map enters a call
        (plan.check_block_map), once per call; the maps derived from it (for_tiles, transposed)
        keep its rows, so the launches read their row_strides unchecked."""
        # a map of more batch rows serves fewer inputs with its first rows, as FlexAttention reads a
        # BlockMask of the whole cache for one request (its decoding tests)
        for name, stored, given in (("B", self.B, batch), ("H", self.H, heads)):
            if stored != 1 and stored != given and not (name == "B" and stored > given):
                raise ValueError(f"block_map was built for {name}={stored} but the inputs have {name}={given}; "
                                 f"build it with {name}={given}")
            if stored == 1 and given > 1 and name.lower() in self._reads:
                # one row serves every b (h) only where the mask does not read it: these are b = 0's
                # tiles (h = 0's), which skip or keep whole tiles the other rows need
                raise MaskcError(f"block_map of mask_mod '{self.mask_name}', which reads {name.lower()}, was built "
                                 f"with {name}=1 but the inputs have {name}={given}: its tiles are those of "
                                 f"{name.lower()}=0 alone; build it with {name}={given} (maskc.block_map(..., "
                                 f"{name}={given}), or create_block_mask(mask_mod, B, H, ...) with {name}={given})")
        return self.row_strides

    @property
    def row_strides(self) -> tuple[int, int]:
        """Row strides of b and h into the run tables and the dense grid (both [B', H', q tiles]
        rows): 0 where one stored row serves every b (h)."""
        return (self.H * self.n_q if self.B > 1 else 0, self.n_q if self.H > 1 else 0)

    @functools.cached_property
    def _reads(self) -> str:
        """Which of b and h the map's mask reads ("bh", "b", "h" or "")."""
        free = dag.free_symbols(self.traced.expr) if self.traced is not None else ()
        return "".join(n for n, symbol in (("b", S.B), ("h", S.H)) if symbol in free)

    def to(self, device) -> "BlockMap":
        """The same map with its run tables on `device`, moved in one copy."""
        device = torch.device(device)
        if device == self.device:
            return self
        new = object.__new__(BlockMap)
        # derived maps, if cached, live on the old device: the new one builds its own
        new.__dict__.update({k: v for k, v in self.__dict__.items() if k not in _TABLES and k != "transposed"})
        new._coarse = {}
        new._register()
        new._buffer = self._buffer.to(device)
        new._set_views()
        return new

    # -- picture ----------------------------------------------------------------------------
    def tiles_of(self, b: int = 0, h: int = 0, max_size: int | None = None) -> tuple[torch.Tensor, int, int]:
        """(grid, step_q, step_kv): int8 verdicts of (b, h)'s tiles on the CPU, each cell covering
        step_q × step_kv tiles so that neither side exceeds `max_size` (a cell is FULL or EMPTY
        where every tile it covers is, else PARTIAL). Counted from the runs, so a long sequence
        never builds its whole tile grid.

        >>> grid, _, _ = maskc.block_map(maskc.masks.causal, 512, 512).tiles_of()
        >>> grid.tolist()[1]
        [2, 1, 0, 0]
        """
        for name, index, stored in (("b", b, self.B), ("h", h, self.H)):
            # a map stored once for every b (or h) has any index
            if index < 0 or 1 < stored <= index:
                raise ValueError(f"{name} must be in [0, {stored}) for this block map, built with "
                                 f"{name.upper()}={stored}, got {index}")
        row0 = ((b if self.B > 1 else 0) * self.H + (h if self.H > 1 else 0)) * self.n_q
        step_q = max(1, -(-self.n_q // max_size)) if max_size else 1
        step_kv = max(1, -(-self.n_kv // max_size)) if max_size else 1
        rows, cols = -(-self.n_q // step_q), -(-self.n_kv // step_kv)
        edges = torch.arange(cols + 1, dtype=torch.int64).mul_(step_kv).clamp_(max=self.n_kv)
        counts = []
        for offsets, runs in ((self.full_offsets, self.full_runs), (self.partial_offsets, self.partial_runs)):
            offsets = offsets[row0:row0 + self.n_q + 1].cpu().long()
            runs = runs[offsets[0]:offsets[-1]].cpu().long()
            row = torch.repeat_interleave(torch.arange(self.n_q), offsets.diff()) // step_q
            count = torch.zeros(rows, cols, dtype=torch.int64)
            # tiles of each run inside each cell's columns, a few thousand runs at a time
            for i in range(0, len(runs), 4096):
                s, e = runs[i:i + 4096, :1], runs[i:i + 4096, 1:]
                covered = (edges - s).clamp(min=0).minimum(e - s)
                count.index_add_(0, row[i:i + 4096], covered.diff(dim=1))
            counts.append(count)
        full, kept = counts[0], counts[0] + counts[1]
        heights = torch.full((rows, 1), step_q, dtype=torch.int64)
        heights[-1] = self.n_q - step_q * (rows - 1)
        size = heights * edges.diff()
        grid = torch.where(kept == 0, EMPTY, torch.where(full == size, FULL, PARTIAL)).to(torch.int8)
        return grid, step_q, step_kv

    def picture(self, b: int = 0, h: int = 0) -> str:
        """The tiles of (b, h) as text, one character per tile (or per cell of tiles past 64 a side),
        under a line of counts and above a legend of the characters."""
        grid, step_q, step_kv = self.tiles_of(b, h, _PICTURE_MAX)
        head = (f"BlockMap({self.mask_name}, q_len={self.q_len}, kv_len={self.kv_len}, block_size={self.block_size}, "
                f"stored B×H={self.B}×{self.H}, tiles {self.n_q}×{self.n_kv}: full={self.num_full} "
                f"partial={self.num_partial} empty={self.num_empty}, sparsity={self.sparsity:.1%})")
        lines = [head]
        if step_q > 1 or step_kv > 1 or (b, h) != (0, 0):
            cells = f"; each character covers {step_q}×{step_kv} tiles" if step_q > 1 or step_kv > 1 else ""
            lines.append(f"(b={b}, h={h}{cells})")
        lines += ["".join(_GLYPHS[v] for v in row) for row in grid.tolist()]
        lines.append(_LEGEND)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.picture()

    def __repr__(self) -> str:
        return self.__str__().splitlines()[0]


def _tiles(runs) -> int:
    return int((runs[:, 1] - runs[:, 0]).sum()) if len(runs) else 0


def _flex_lists(sel):
    num = sel.sum(-1).to(torch.int32)
    # stable sort puts the selected tiles first, in increasing order
    idx = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num, idx


def _flex_grid(num, idx, n_kv: int, name: str) -> torch.Tensor:
    """bool [B, H, q_blocks, n_kv]: the blocks that `num` and `idx` list (FlexAttention's
    form: row r lists idx[..., r, :num[..., r]]; entries past num are undefined)."""
    listed = torch.arange(idx.shape[-1], device=idx.device) < num.unsqueeze(-1).long()
    if num.numel() and int(num.max()) > idx.shape[-1]:
        raise ValueError(f"block_mask lists up to {int(num.max())} blocks in a row but {name} holds "
                         f"{idx.shape[-1]}; build it with BlockMask.from_kv_blocks or create_block_mask")
    if bool((listed & (idx < 0)).any()):
        raise ValueError(f"block_mask's {name} lists a negative block index; build it with create_block_mask or "
                         f"BlockMask.from_kv_blocks from block indices in [0, {n_kv})")
    # blocks listed past the keys hold no key FlexAttention attends (its kernels mask keys past
    # KV_LEN): torch 2.13's BlockMask._adjust keeps such full blocks when it crops the keys
    listed &= idx < n_kv
    cols = torch.where(listed, idx.long(), n_kv)  # unlisted entries land in a spare last column
    count = torch.zeros(*idx.shape[:-1], n_kv + 1, dtype=torch.int32, device=idx.device)
    count.scatter_add_(-1, cols, listed.to(torch.int32))
    if bool((count[..., :n_kv] > 1).any()):
        raise ValueError(f"block_mask's {name} lists a kv block twice in one row, which flex_attention would "
                         f"attend twice; list each block once")
    return count[..., :n_kv] > 0
