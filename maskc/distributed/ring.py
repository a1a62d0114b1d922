"""attention(): each rank's queries against every rank's keys, around a ring that skips what the mask drops.

At ring step s, rank r holds the keys and values of rank (r - s) mod N and computes the
(query chunk, key chunk) pairs of its plan at that step, each one launch of the ordinary
kernels (maskc/runtime/launch.py) with a mask and score mod that add the chunks' global starts
to q_idx and kv_idx, so the user's mods see global positions. Partial outputs merge by their
LSE. The keys travel directly from r - s to r: on one node every pair of GPUs has its own
link, and a relay through r - 1 would carry a shard through ranks that do not need it. A step
at which r needs no key of r - s sends nothing. The next step's keys are in flight
(batch_isend_irecv) while this step computes.

The backward recomputes with the merged output and LSE (P = exp(S - lse) is then each pair's
share of the row): dQ stays home, and the dK/dV of rank r - s's keys go back to it directly.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from maskc.distributed import agree
from maskc.distributed.plan import ContextParallelPlan
from maskc.errors import MaskcError
from maskc.runtime import launch
from maskc.runtime import plan as planning
from maskc.runtime import state, tiles
from maskc.runtime.dtypes import accumulator
from maskc.runtime.sinks import check_sinks, with_sinks
from maskc.trace.mods import MaskMod, ScoreMod, as_score_mod, captured_needing_grad

_RINGS = 8  # the score mods a plan keeps the pair mods and Problems of
_PROBLEMS = 1024
_AGREEMENTS = 64  # the call signatures a ring keeps the description of (agree.py)
# Every live ring, so that maskc.clear_caches() reaches the caches each keeps (runtime/state.py).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _clear_rings() -> None:
    for ring in list(_LIVE):
        ring.clear()


state.register(__name__, "_LIVE", "each live ring's Problems, pair mods and call descriptions",
               f"{_PROBLEMS} Problems a ring, {_RINGS} rings a plan (one per score mod), while the plan lives",
               size=lambda: sum(len(ring.problems) for ring in list(_LIVE)), clear=_clear_rings)


# Under torch.compile the call is a graph break: its communication and planning run eagerly, and
# autograd links the compiled parts on either side through it.
@torch.compiler.disable
def attention(q, k, v, plan: ContextParallelPlan, *, score_mod=None, scale=None, enable_gqa=False,
              return_lse=False, sinks=None):
    """Attention of this rank's query shard over the whole sequence, whose keys and values are
    sharded over the plan's group; differentiable in q, k, v (and a score mod's captured tensors).

    q [B, Hq, plan.local_len, D], k and v [B, Hkv, plan.local_len, D/Dv], as plan.shard gives
    them. Returns this rank's out [B, Hq, plan.local_len, Dv] (and lse [B, Hq, plan.local_len]
    with return_lse). The plan's mask_mod and score_mod see global positions. Every rank of the
    group calls it (and its backward) together, alike but for its shard: each call compares the
    ranks' calls with one 8-byte all-reduce, and where they differ (shapes, dtype, scale,
    score_mod, plan) or one rank's own checks fail, every rank raises.
    sinks [Hq], attention sinks as compiled_attention's, join each row once, after the ring's
    merge; every rank passes the same sinks, and their gradient is summed over the group, as a
    captured tensor's.

    >>> plan = maskc.distributed.plan(maskc.masks.causal, seq_len)
    >>> out = maskc.distributed.attention(plan.shard(q), plan.shard(k), plan.shard(v), plan)
    """
    if not isinstance(plan, ContextParallelPlan):
        raise TypeError(f"plan must be a ContextParallelPlan from maskc.distributed.plan, got {type(plan).__name__}")
    try:
        planning.check_tensors(q, k, v, enable_gqa)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[2] != plan.local_len:
                raise ValueError(f"{name} must hold this rank's shard of {plan.local_len} positions (plan.shard of "
                                 f"the full tensor), got shape {tuple(t.shape)}")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k and v must have q's batch size under context parallelism, got {k.shape[0]} and "
                             f"{q.shape[0]}; expand them")
        plan.check_current(q.shape[0], q.shape[1])
        score = as_score_mod(score_mod)
        traced = score.traced if score is not None else None  # re-traced where its guards fail, which may refuse
        scale = planning.softmax_scale(scale, q.shape[3])
        if sinks is not None:
            check_sinks(sinks, q)
    except (MaskcError, ValueError, TypeError) as error:
        # the other ranks wait in this call's exchange: answer them, so that they raise too
        raise agree.refused(plan, error)
    ring = _Ring.of(plan, score)
    captured = captured_needing_grad(traced)
    differentiable = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v)) or bool(captured))
    sinks_grad = sinks is not None and torch.is_grad_enabled() and sinks.requires_grad
    # a backward that sums the sinks' gradient is a collective too: every rank must record it
    ring.agree(traced, q, k, v, scale, differentiable or sinks_grad)
    if differentiable:
        out, lse = _RingFunction.apply(q, k, v, ring, scale, *captured)
    else:
        out, lse = ring.forward(q, k, v, scale, differentiable=False)
    if sinks is not None:
        out, lse = with_sinks(out, lse, _SummedOverGroup.apply(sinks, plan.group) if sinks_grad else sinks)
    return (out, lse) if return_lse else out


def _shifted_mask(mask: MaskMod, q_start: int, kv_start: int) -> MaskMod:
    # q_start and kv_start are captured numbers, so kernel parameters: every pair shares one kernel
    def at_global_positions(b, h, q_idx, kv_idx):
        return mask(b, h, q_idx + q_start, kv_idx + kv_start)

    return MaskMod(at_global_positions, name=mask.__name__)


def _shifted_score(score: ScoreMod, q_start: int, kv_start: int) -> ScoreMod:
    def at_global_positions(s, b, h, q_idx, kv_idx):
        return score(s, b, h, q_idx + q_start, kv_idx + kv_start)

    return ScoreMod(at_global_positions, name=score.__name__)


class _Ring:
    """The mods of each (query chunk, key chunk) pair of a plan and score mod, and the ring's
    forward and backward over them."""

    @staticmethod
    def of(plan: ContextParallelPlan, score) -> _Ring:
        key = id(score)
        ring = plan._rings.get(key)
        if ring is None or ring.score is not score:
            ring = plan._rings[key] = _Ring(plan, score)
            if len(plan._rings) > _RINGS:  # a score mod made anew on each call must not pile up
                del plan._rings[next(iter(plan._rings))]
        return ring

    def __init__(self, plan: ContextParallelPlan, score):
        self.plan = plan
        self.score = score
        self._mods: dict = {}
        self.problems: dict = {}
        self._agreements: dict = {}
        _LIVE.add(self)

    def clear(self) -> None:
        """Forget the pairs' mods, Problems and call descriptions; the next call makes them again."""
        self._mods.clear()
        self.problems.clear()
        self._agreements.clear()

    def agree(self, traced, q, k, v, scale: float, differentiable: bool) -> None:
        """Check that every rank makes this call alike (agree.check, a collective), describing the
        call once per local signature; `traced` is the score mod's current trace."""
        # values only, no tensors: a score mod re-traced on every call must not keep old ones alive
        score = None if traced is None else (traced.signature, tuple(p.value for p in traced.params),
                                             tuple((t.shape, t.dtype, t.requires_grad) for t in traced.tensors))
        key = (score, q.shape, k.shape, v.shape, q.dtype, scale, differentiable)
        found = self._agreements.get(key)
        if found is None:
            if len(self._agreements) >= _AGREEMENTS:  # a captured number that changes on every call
                self._agreements.clear()
            description = self._description(traced, q, k, v, scale, differentiable)
            found = self._agreements[key] = (agree.digest(description), description)
        agree.check(self.plan, *found)

    def _description(self, traced, q, k, v, scale: float, differentiable: bool) -> dict[str, str]:
        """What every rank's call must share: the plan, shapes but for the positions (GQA follows
        from the heads), dtype, scale, score mod, and whether a backward will run the ring again
        (and reduce the captured tensors' gradients over the group)."""
        plan = self.plan

        def shape(t):
            return f"[{t.shape[0]}, {t.shape[1]}, *, {t.shape[3]}] {str(t.dtype).removeprefix('torch.')}"

        def tensor(t):
            return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}{' learnable' if t.requires_grad else ''}"

        name = plan.mask_mod.__name__ if plan.mask_mod is not None else "none"
        score = "none" if traced is None else (
            f"'{self.score.__name__}' (expression {traced.digest}, numbers {tuple(p.value for p in traced.params)}, "
            f"tensors ({', '.join(tensor(t) for t in traced.tensors)}))")
        return {"plan": f"{plan.layout} layout of {plan.seq_len} positions, mask '{name}' "
                        f"(fingerprint {plan._fingerprint:08x})",
                "q": shape(q), "k": shape(k), "v": shape(v), "scale": repr(scale), "score_mod": score,
                "backward": "recorded" if differentiable else "not recorded"}

    def _mods_of(self, qc: int, kc: int):
        mods = self._mods.get((qc, kc))
        if mods is None:
            q_lo, _, kv_lo, _ = self.plan._layout.ranges[(qc, kc)]
            q_start, kv_start = self.plan._layout.bounds[qc][0] + q_lo, self.plan._layout.bounds[kc][0] + kv_lo
            mask, score = self.plan.mask_mod, self.score
            mods = self._mods[(qc, kc)] = (_shifted_mask(mask, q_start, kv_start) if mask is not None else None,
                                           _shifted_score(score, q_start, kv_start) if score is not None else None)
        return mods

    def _pieces(self, step: int, q, keys, scale: float, differentiable: bool):
        """(query slice, key slice, q, k, v parts, Problem) of each pair this rank computes at
        `step`, with `keys` (k, v, where each key chunk starts in them) from rank (rank - step) mod N."""
        plan = self.plan
        k, v, starts = keys
        mine = {c: offset for c, _, offset in plan.chunks(plan.rank)}
        for qc, kc in plan.pairs(step):
            q_lo, q_hi, kv_lo, kv_hi = plan._layout.ranges[(qc, kc)]
            qs, ks = slice(mine[qc] + q_lo, mine[qc] + q_hi), slice(starts[kc] + kv_lo, starts[kc] + kv_hi)
            q_part, k_part, v_part = q[:, :, qs], k[:, :, ks], v[:, :, ks]
            mask, score = self._mods_of(qc, kc)
            # the traces (re-checked by their guards: a score mod's captured number may change) and
            # everything else a Problem is planned from; captured tensors are read at launch
            score_traced = score.traced if score else None
            key = (step, qc, kc, mask.traced if mask else None, score_traced, q.shape, k_part.shape, v.shape[3],
                   q.dtype, q.device, scale, differentiable, tiles.override_key(),
                   tuple(t.requires_grad for t in score_traced.tensors) if score_traced else (),
                   # in-place updates: a Problem holds float32 copies of float64 score tensors and
                   # whether an index can be negative, both read from the values (plan.problem_of)
                   tuple(x._version for t in (mask.traced if mask else None, score_traced) if t for x in t.tensors))
            problem = self.problems.get(key)
            if problem is None:
                if len(self.problems) >= _PROBLEMS:  # traces that changed leave their Problems behind
                    self.problems.clear()
                # the backward runs without grad mode: plan here whether captured tensors need gradients
                with torch.set_grad_enabled(differentiable):
                    problem = self.problems[key] = planning.planned(q_part, k_part, v_part, mask, score, scale,
                                                                     launch.seconds)
            yield qs, ks, q_part, k_part, v_part, problem

    def forward(self, q, k, v, scale: float, *, differentiable: bool):
        plan = self.plan
        B, Hq, Lq, _ = q.shape
        acc = torch.zeros((B, Hq, Lq, v.shape[3]), dtype=accumulator(q.dtype), device=q.device)
        lse = torch.full((B, Hq, Lq), float("-inf"), dtype=accumulator(q.dtype), device=q.device)
        ring = _Exchange(plan, k, v)
        written: list[tuple[int, int]] = []  # row ranges holding a pair's result
        for step, keys in ring.arrivals():
            for qs, _, q_part, k_part, v_part, problem in self._pieces(step, q, keys, scale, differentiable):
                out_p, lse_p = launch.forward(q_part, k_part, v_part, problem)
                if any(lo < qs.stop and qs.start < hi for lo, hi in written):
                    _merge(acc[:, :, qs], lse[:, :, qs], out_p, lse_p)
                else:  # the first result for these rows: nothing to merge with
                    acc[:, :, qs] = out_p
                    lse[:, :, qs] = lse_p
                written.append((qs.start, qs.stop))
        return acc.to(q.dtype), lse

    def backward(self, q, k, v, out, lse, d_out, d_lse, scale: float, captured):
        plan = self.plan
        dq = torch.zeros_like(q, dtype=accumulator(q.dtype))
        dk = torch.zeros_like(k, dtype=accumulator(q.dtype))
        dv = torch.zeros_like(v, dtype=accumulator(q.dtype))
        grads = {id(t): torch.zeros_like(t, dtype=torch.float64) for t in captured}
        d_out = torch.zeros_like(out) if d_out is None else d_out
        ring = _Exchange(plan, k, v)
        for step, keys in ring.arrivals(every_step=True):
            dk_s = dv_s = None
            if keys is not None:
                dk_s, dv_s = (dk, dv) if step == 0 else (torch.zeros_like(keys[0], dtype=dk.dtype),
                                                         torch.zeros_like(keys[1], dtype=dv.dtype))
                for qs, ks, q_part, k_part, v_part, problem in self._pieces(step, q, keys, scale, True):
                    dq_p, dk_p, dv_p, *g = launch.backward(
                        q_part, k_part, v_part, out[:, :, qs], lse[:, :, qs], d_out[:, :, qs],
                        None if d_lse is None else d_lse[:, :, qs], problem, partial=True)
                    dq[:, :, qs] += dq_p
                    dk_s[:, :, ks] += dk_p
                    dv_s[:, :, ks] += dv_p
                    for t, grad in zip(problem.grad_tensors, g):
                        grads[id(t)] += grad
            if step:
                ring.post_gradients(step, dk_s, dv_s)
        for positions, d_k, d_v in ring.gradients_home():
            dk[:, :, positions] += d_k
            dv[:, :, positions] += d_v
        captured_grads = []
        for t in captured:
            total = grads[id(t)]
            dist.all_reduce(total, group=plan.group)
            captured_grads.append(total.to(t.dtype))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), captured_grads


def _merge(acc, lse, out_p, lse_p) -> None:
    """Fold a pair's (out_p, lse_p) into the running (acc, lse) of its rows, in place."""
    new = torch.logaddexp(lse, lse_p)
    # rows no pair has kept yet stay at lse -inf and output 0 (exp(-inf - 0) = 0, never NaN)
    finite = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    acc.mul_(torch.exp(lse - finite).unsqueeze(-1)).addcmul_(out_p, torch.exp(lse_p - finite).unsqueeze(-1))
    lse.copy_(new)


class _Exchange:
    """The ring's point-to-point traffic for one pass. A step sends only the keys its receiver
    reads (plan.keys_needed), packed in the sender's shard order. Every rank walks the same ring
    steps in the same order and posts its messages of each step in one order (keys, then
    values, then gradients), so each pair of ranks matches sends and receives as NCCL requires."""

    def __init__(self, plan: ContextParallelPlan, k, v):
        self.plan = plan
        self.k, self.v = k, v
        # steps at which any rank sends keys: the same list on every rank
        self.steps = [s for s in plan.steps if s > 0]
        self._received: list = []
        self._requests: list = []

    def _peer(self, rank: int) -> int:
        group = self.plan.group
        return rank if group is None else dist.get_global_rank(group, rank)

    def _spans(self, step: int, rank: int):
        """The keys `rank` receives at `step`, packed: for each key chunk (chunk, where its keys
        start in the packed tensor, where the chunk itself would start there, their offset in the
        sender's shard, how many), and the packed length."""
        plan = self.plan
        offsets = {c: offset for c, _, offset in plan.chunks((rank - step) % plan.world_size)}
        spans, packed = [], 0
        for kc, lo, hi in plan.keys_needed(step, rank):
            spans.append((kc, packed, packed - lo, offsets[kc] + lo, hi - lo))
            packed += hi - lo
        return spans, packed

    def _post_keys(self, step: int):
        """Receive the keys rank - step sends us where this rank computes at `step`, and send
        rank + step the keys it reads. Returns ((k, v, chunk starts) or None, requests)."""
        plan, n, r = self.plan, self.plan.world_size, self.plan.rank
        group, ops, keys = plan.group, [], None
        spans, packed = self._spans(step, r)
        if spans:
            source = self._peer((r - step) % n)
            k, v = (torch.empty((*t.shape[:2], packed, t.shape[3]), dtype=t.dtype, device=t.device)
                    for t in (self.k, self.v))
            keys = (k, v, {kc: chunk_start for kc, _, chunk_start, _, _ in spans})
            ops += [dist.P2POp(dist.irecv, k, source, group, 4 * step),
                    dist.P2POp(dist.irecv, v, source, group, 4 * step + 1)]
        target = (r + step) % n
        spans, _ = self._spans(step, target)
        if spans:
            k, v = (_packed(t, [(offset, length) for _, _, _, offset, length in spans]) for t in (self.k, self.v))
            ops += [dist.P2POp(dist.isend, k, self._peer(target), group, 4 * step),
                    dist.P2POp(dist.isend, v, self._peer(target), group, 4 * step + 1)]
        return keys, (dist.batch_isend_irecv(ops) if ops else [])

    def arrivals(self, every_step: bool = False):
        """Yield (step, (k, v, chunk starts)) for each step at which this rank computes, with
        the keys of rank - step, while the next step's keys are in flight; with every_step,
        also (step, None) for the ring's other steps, so that the caller can post each step's
        gradients at the same point of the order on every rank."""
        pending = self._post_keys(self.steps[0]) if self.steps else (None, [])
        if self.plan.pairs(0):
            yield 0, (self.k, self.v, {c: offset for c, _, offset in self.plan.chunks(self.plan.rank)})
        for i, step in enumerate(self.steps):
            keys, requests = pending
            for request in requests:
                request.wait()
            pending = self._post_keys(self.steps[i + 1]) if i + 1 < len(self.steps) else (None, [])
            if keys is not None or every_step:
                yield step, keys

    def post_gradients(self, step: int, dk, dv) -> None:
        """Send the dK/dV of the packed keys this rank read at `step` (None: it read none) home
        to rank - step, and receive those rank + step computed for the keys we sent it."""
        plan, n, r = self.plan, self.plan.world_size, self.plan.rank
        ops = []
        source = (r + step) % n
        spans, packed = self._spans(step, source)
        if spans:
            d_k, d_v = (torch.empty((*t.shape[:2], packed, t.shape[3]), dtype=accumulator(t.dtype), device=t.device)
                        for t in (self.k, self.v))
            ops += [dist.P2POp(dist.irecv, d_k, self._peer(source), plan.group, 4 * step + 2),
                    dist.P2POp(dist.irecv, d_v, self._peer(source), plan.group, 4 * step + 3)]
            self._received.append((spans, d_k, d_v))
        if dk is not None:
            target = self._peer((r - step) % n)
            ops += [dist.P2POp(dist.isend, dk, target, plan.group, 4 * step + 2),
                    dist.P2POp(dist.isend, dv, target, plan.group, 4 * step + 3)]
        if ops:
            self._requests += dist.batch_isend_irecv(ops)

    def gradients_home(self):
        """(positions in this rank's shard, dK, dV) of each range of our keys another rank read,
        once every send has finished."""
        for request in self._requests:
            request.wait()
        for spans, d_k, d_v in self._received:
            for _, at, _, offset, length in spans:
                yield slice(offset, offset + length), d_k[:, :, at:at + length], d_v[:, :, at:at + length]


def _packed(t, spans):
    """The rows `spans` ((offset, length) along positions) of t, contiguous: t itself where they
    are all of it."""
    if len(spans) == 1 and spans[0] == (0, t.shape[2]):
        return t.contiguous()
    return torch.cat([t[:, :, offset:offset + length] for offset, length in spans], dim=2)


class _SummedOverGroup(torch.autograd.Function):
    """The identity, whose gradient is summed over the group: each rank's rows give their own
    share of the gradient of a tensor every rank shares (the sinks)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float, *captured):
        out, lse = ring.forward(q, k, v, scale, differentiable=True)
        ctx.save_for_backward(q, k, v, out, lse, *captured)
        ctx.ring, ctx.scale = ring, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, *captured = ctx.saved_tensors
        dq, dk, dv, grads = ctx.ring.backward(q, k, v, out, lse, d_out, d_lse, ctx.scale, captured)
        return dq, dk, dv, None, None, *grads


__all__ = ["attention"]
