"""The Triton kernels of maskc.PagedKVCache (maskc/inference/paged.py).

Loaded by paged.py through loader.load, compiled for CUDA or interpreted for CPU tensors;
never imported as a module of maskc.

# P: tokens per page; a slot's token at position pos lies in row pos % P of page
#    page_table[slot, pos // P]
# held: pages a slot holds before an append, cdiv(len, P); need: the new pages it takes,
#    cdiv(len + T, P) - held
# before: the new pages of the slots ahead of it in the batch (exclusive prefix sum of need)
# free stack: free[0:top] are the free pages; pops take free[top - 1], free[top - 2], ...
# status: int64 [failures since the last check, then the first one's kind, op, a, b, c]
# counter: int32 [1], the append's programs that are done; the last one resets it to 0
# marks: int32 [max_seqs] scratch, to find a slot named twice in a batch
"""
import triton
import triton.language as tl

# status[1], the kind of a refused call, and what a, b, c hold for it
OUT_OF_PAGES = tl.constexpr(1)  # a: pages the batch needs, b: pages free
OVER_CAPACITY = tl.constexpr(2)  # a: slot, b: its length, c: tokens appended
BAD_SLOT = tl.constexpr(3)  # a: a seq_id outside [0, max_seqs)
DUPLICATE_SLOT = tl.constexpr(4)  # a: a slot named twice
# status[2], the call refused
APPEND = tl.constexpr(1)
FREE = tl.constexpr(2)


@triton.jit
def append_kernel(seq_ids, B, T, k, v, k_pages, v_pages, page_table, lens, free, top, counter, marks, status,
                  stride_kb, stride_kh, stride_kt, stride_kd, stride_vb, stride_vh, stride_vt, stride_vd,
                  stride_kpn, stride_kpp, stride_kph, stride_kpd, stride_vpn, stride_vpp, stride_vph, stride_vpd,
                  stride_table, max_seqs, capacity, H, D, DV,
                  P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Grid (cdiv(T, BLOCK_T), B): program (chunk, b) copies tokens chunk*BLOCK_T.. of every
    head of batch row b into the pages of slot seq_ids[b]."""
    chunk = tl.program_id(0)
    b = tl.program_id(1)
    # NOTE: every program reads the lengths of the whole batch and the stack's top, and derives
    # the same plan from them: which pages each row pops, and whether the batch fits. No
    # program waits for another, and no program writes what another reads (lens and top are
    # written only by the last one, after all have read them; see the counter below).
    batch = tl.arange(0, BLOCK_B)
    slots, valid, bad = _batch(seq_ids, B, max_seqs, batch)
    old = tl.load(lens + slots, mask=valid, other=0).to(tl.int64)
    held = (old + P - 1) // P
    need = tl.where(valid, (old + T + P - 1) // P - held, 0)
    before = tl.associative_scan(need, 0, _add) - need
    total = _total(need)
    free_count = tl.load(top).to(tl.int64)
    over = valid & (old + T > capacity)
    # a batch that does not fit writes nothing: pages popped below the stack's bottom are pages
    # in use, and a page index past max_pages_per_seq lands in the next slot's page-table row
    fits = (_count(bad) == 0) & (_count(over) == 0) & (total <= free_count)

    slot = _pick(slots, batch, b)
    old_b = _pick(old, batch, b)
    held_b = _pick(held, batch, b)
    before_b = _pick(before, batch, b)
    rows = tl.arange(0, BLOCK_T * BLOCK_H)
    t = (chunk * BLOCK_T + rows // BLOCK_H).to(tl.int64)
    h = rows % BLOCK_H
    # a refused batch copies no token (a scalar `fits` is not and-ed into the mask: Triton 3.9's
    # interpreter makes that an int32 mask, which tl.load refuses)
    live = (t < tl.where(fits, T, 0)) & (h < H)
    pos = old_b + t
    index = pos // P
    fresh = index >= held_b
    table_row = page_table + slot.to(tl.int64) * stride_table
    # the slot's last page first (when it has room), then the pages this row pops, in order
    kept = tl.load(table_row + index, mask=live & (index < held_b), other=0)
    popped = tl.load(free + (free_count - 1 - before_b - (index - held_b)), mask=live & fresh, other=0)
    page = tl.where(fresh, popped, kept).to(tl.int64)
    row = pos % P
    _copy(k + b.to(tl.int64) * stride_kb + h * stride_kh + t * stride_kt, stride_kd,
          k_pages + page * stride_kpn + row * stride_kpp + h * stride_kph, stride_kpd, live, D, BLOCK_D)
    _copy(v + b.to(tl.int64) * stride_vb + h * stride_vh + t * stride_vt, stride_vd,
          v_pages + page * stride_vpn + row * stride_vpp + h * stride_vph, stride_vpd, live, DV, BLOCK_DV)
    # a new page's table entry is written by the program that holds its first token
    tl.store(table_row + index, page.to(tl.int32), mask=live & fresh & (row == 0) & (h == 0))

    # NOTE: the program that counts itself last writes lens and top after every program has
    # read them: the barrier orders all of this program's threads' reads before its atomic,
    # whose acq_rel semantics (the default, at GPU scope) release them to the last program.
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1)
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        tl.store(counter, 0)
        twice = _named_twice(marks, slots, valid, batch)
        if fits & (_count(twice) == 0):
            tl.store(lens + slots, (old + T).to(tl.int32), mask=valid)
            tl.store(top, (free_count - total).to(tl.int32))
        else:
            # A refused batch may have written its tokens past the lengths (a duplicate slot is
            # only seen here) and page-table entries past the slots' pages: neither is stored
            # data, and no page left the stack.
            if _count(bad) > 0:
                _refuse(status, BAD_SLOT, APPEND, _first(bad, slots, batch, BLOCK_B), 0, 0)
            elif _count(twice) > 0:
                _refuse(status, DUPLICATE_SLOT, APPEND, _first(twice, slots, batch, BLOCK_B), 0, 0)
            elif _count(over) > 0:
                _refuse(status, OVER_CAPACITY, APPEND, _first(over, slots, batch, BLOCK_B),
                        _first(over, old, batch, BLOCK_B), T)
            else:
                _refuse(status, OUT_OF_PAGES, APPEND, total, free_count, 0)


@triton.jit
def free_kernel(seq_ids, B, page_table, stride_table, lens, free, top, marks, status, max_seqs,
                P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_PAGES: tl.constexpr):
    """Grid (1,): pushes the pages of slots seq_ids[0:B] on the free stack and zeroes their lengths."""
    batch = tl.arange(0, BLOCK_B)
    slots, valid, bad = _batch(seq_ids, B, max_seqs, batch)
    # a slot freed twice would push its pages twice, and later appends would share them
    twice = _named_twice(marks, slots, valid, batch)
    if _count(bad) > 0:
        _refuse(status, BAD_SLOT, FREE, _first(bad, slots, batch, BLOCK_B), 0, 0)
    elif _count(twice) > 0:
        _refuse(status, DUPLICATE_SLOT, FREE, _first(twice, slots, batch, BLOCK_B), 0, 0)
    else:
        held = (tl.load(lens + slots, mask=valid, other=0) + P - 1) // P
        before = tl.associative_scan(held, 0, _add) - held
        free_count = tl.load(top)
        for i in range(0, B):
            table_row = page_table + _pick(slots, batch, i).to(tl.int64) * stride_table
            n = _pick(held, batch, i)
            start = free + free_count + _pick(before, batch, i)
            for j in range(0, n, BLOCK_PAGES):
                index = j + tl.arange(0, BLOCK_PAGES)
                tl.store(start + index, tl.load(table_row + index, mask=index < n), mask=index < n)
        tl.store(lens + slots, 0, mask=valid)
        tl.store(top, free_count + _total(held))


@triton.jit
def _batch(seq_ids, B, max_seqs, batch):
    """The batch's slots, which of them are usable, and which are outside [0, max_seqs)."""
    in_batch = batch < B
    slots = tl.load(seq_ids + batch, mask=in_batch, other=0)
    valid = in_batch & (slots >= 0) & (slots < max_seqs)
    return slots, valid, in_batch & ((slots < 0) | (slots >= max_seqs))


@triton.jit
def _named_twice(marks, slots, valid, batch):
    """Rows whose slot another row also names (all but one of them): each row marks its slot
    with its own index, and one index wins a slot named twice."""
    tl.store(marks + slots, batch.to(tl.int32), mask=valid)
    # NOTE: the marks are read back by other threads of the program
    tl.debug_barrier()
    return valid & (tl.load(marks + slots, mask=valid, other=0) != batch)


# NOTE: reductions and scans combine with these rather than tl.sum / tl.cumsum / tl.min, which are
# @triton.jit library functions that Triton's interpreter cannot call unless it was enabled
# before triton was imported (the templates' prelude does the same).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _min(a, b):
    return tl.minimum(a, b)


@triton.jit
def _total(x):
    return tl.reduce(x, 0, _add)


@triton.jit
def _count(flags):
    return _total(flags.to(tl.int32))


@triton.jit
def _pick(x, batch, i):
    return _total(tl.where(batch == i, x, 0))


@triton.jit
def _first(cond, x, batch, BLOCK_B: tl.constexpr):
    return _pick(x, batch, tl.reduce(tl.where(cond, batch, BLOCK_B), 0, _min))


@triton.jit
def _copy(src, stride_src, dst, stride_dst, live, D, BLOCK_D: tl.constexpr):
    """Rows of D elements from src to dst: [rows] pointers, element strides."""
    d = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (d[None, :] < D)
    values = tl.load(src[:, None] + d[None, :] * stride_src, mask=mask)
    tl.store(dst[:, None] + d[None, :] * stride_dst, values, mask=mask)


@triton.jit
def _refuse(status, kind, op, a, b, c):
    """Counts a refused call; the first since the last check records what it was."""
    failures = tl.load(status)
    tl.store(status, failures + 1)
    if failures == 0:
        tl.store(status + 1, kind)
        tl.store(status + 2, op)
        tl.store(status + 3, a)
        tl.store(status + 4, b)
        tl.store(status + 5, c)
