"""Evaluate a traced expression on torch tensors, with the kernel's semantics.

This is the dense fallback of the block-map analysis (and of reclassifying tiles the
interval analysis could not decide). Python semantics throughout: `//` floors, `%` takes
the divisor's sign; a captured-tensor index out of range reads 0 (False for bool tensors),
exactly as the generated kernel does.
"""
from __future__ import annotations

import sympy
import torch

from maskc.trace.symbols import B, H, KV_IDX, Q_IDX, SCORE


def evaluate(expr, env: dict, tensors, params: dict):
    """Value of `expr` with index symbols bound to tensors in `env` (keys B, H, Q_IDX, KV_IDX,
    optionally SCORE), captured tensors by slot, and parameter symbols bound in `params`."""
    return _Evaluator(env, tensors, params).run(expr)


class _Evaluator:
    def __init__(self, env, tensors, params):
        self.env, self.tensors, self.params = env, tensors, params

    def run(self, e):
        if e is sympy.true:
            return torch.tensor(True)
        if e is sympy.false:
            return torch.tensor(False)
        if isinstance(e, sympy.Integer):
            return torch.tensor(int(e))
        if isinstance(e, (sympy.Rational, sympy.Float)) or e.is_Number:
            return torch.tensor(float(e), dtype=torch.float64)
        if isinstance(e, sympy.Symbol):
            if e in self.env:
                return self.env[e]
            return torch.tensor(self.params[e])
        if e is sympy.pi or e is sympy.E:
            return torch.tensor(float(e), dtype=torch.float64)
        method = getattr(self, "_" + type(e).__name__, None)
        if method is None:
            raise NotImplementedError(f"dense evaluation of {type(e).__name__} ({e}) is not implemented")
        return method(e)

    def _args(self, e):
        return [self.run(a) for a in e.args]

    def _Add(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = out + self.run(a)
        return out

    def _Mul(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = out * self.run(a)
        return out

    def _Pow(self, e):
        base, exp = self._args(e)
        if e.exp.is_Integer and int(e.exp) < 0:
            return 1.0 / base.to(torch.float64) ** (-int(e.exp))
        return base**exp

    def _floor(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den != 1:
            return torch.div(self.run(num), self.run(den), rounding_mode="floor")
        return torch.floor(self.run(e.args[0]))

    def _Mod(self, e):
        a, b = self._args(e)
        return torch.remainder(a, b)

    def _Min(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = torch.minimum(*torch.broadcast_tensors(out, self.run(a)))
        return out

    def _Max(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = torch.maximum(*torch.broadcast_tensors(out, self.run(a)))
        return out

    def _Abs(self, e):
        return torch.abs(self.run(e.args[0]))

    def _exp(self, e):
        return torch.exp(self.run(e.args[0]).to(torch.float64))

    def _log(self, e):
        return torch.log(self.run(e.args[0]).to(torch.float64))

    def _tanh(self, e):
        return torch.tanh(self.run(e.args[0]).to(torch.float64))

    def _Piecewise(self, e):
        out = self.run(e.args[-1].expr)
        for branch in reversed(e.args[:-1]):
            out = torch.where(self.run(branch.cond), self.run(branch.expr), out)
        return out

    def _GreaterThan(self, e):
        a, b = self._args(e)
        return a >= b

    def _StrictGreaterThan(self, e):
        a, b = self._args(e)
        return a > b

    def _LessThan(self, e):
        a, b = self._args(e)
        return a <= b

    def _StrictLessThan(self, e):
        a, b = self._args(e)
        return a < b

    def _Equality(self, e):
        a, b = self._args(e)
        return a == b

    def _Unequality(self, e):
        a, b = self._args(e)
        return a != b

    def _And(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = out & self.run(a)
        return out

    def _Or(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = out | self.run(a)
        return out

    def _Xor(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = out ^ self.run(a)
        return out

    def _Not(self, e):
        return ~self.run(e.args[0])

    def _load(self, e):
        tensor = self.tensors[int(e.args[0])]
        index = [self.run(i) for i in e.args[1:]]
        index = torch.broadcast_tensors(*index) if index else []
        inside = torch.tensor(True)
        clamped = []
        for dim, i in enumerate(index):
            inside = inside & (i >= 0) & (i < tensor.shape[dim])
            clamped.append(i.clamp(0, tensor.shape[dim] - 1).to(torch.long))
        value = tensor.to(self._device())[tuple(clamped)] if clamped else tensor.to(self._device()).reshape(())
        if value.dtype == torch.bool:
            value = value.to(torch.int64)
        return torch.where(inside.to(value.device), value, torch.zeros((), dtype=value.dtype, device=value.device))

    _LoadInt = _LoadFloat = _LoadBool = _load

    def _device(self):
        for v in self.env.values():
            return v.device
        return torch.device("cpu")


def symbols_env(b, h, q_idx, kv_idx, score=None) -> dict:
    env = {B: b, H: h, Q_IDX: q_idx, KV_IDX: kv_idx}
    if score is not None:
        env[SCORE] = score
    return env


