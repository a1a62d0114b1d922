"""Evaluate a traced expression on torch tensors, with the kernel's semantics.

This is the dense fallback of the block-map analysis (and of reclassifying tiles the
interval analysis could not decide). Python and torch semantics throughout: `//` floors,
`%` takes the divisor's sign; integer operations on int64 (shifts as torch's: counts past
the width give 0 or the sign); Trunc rounds toward zero; sign(0) = 0; a negative
captured-tensor index counts from the end (torch's t[-1]) and one still out of range reads 0
(False for bool tensors), exactly as the generated kernel does,
and an element is read as int64, so that arithmetic on it cannot wrap (as the kernel reads an
integer element that meets arithmetic; one only compared it reads as int32). Floats are float32, as the kernel computes them and as torch computes
index arithmetic with float literals, unless a float64 tensor makes them float64: a float64
evaluation decided a tile EMPTY where float32, the kernel's and torch's, keeps a pair
(q_idx / 5 + q_idx * 0.3 == 2.0 holds in float32 at q_idx = 4).

Each distinct node is evaluated once: nested torch.where builds expressions whose tree is
exponentially larger than the number of distinct nodes. A value needed again is kept only
until its last use, so that memory stays near what evaluating the tree would hold.
"""
from __future__ import annotations

import sympy
import torch

from maskc.trace.proxy import integral, multiplied_out, quotient
from maskc.trace.symbols import B, H, KV_IDX, Q_IDX, SCORE


def evaluate(expr, env: dict, tensors, params: dict, floats: torch.dtype = torch.float32):
    """Value of `expr` with index symbols bound to tensors in `env` (keys B, H, Q_IDX, KV_IDX,
    optionally SCORE), captured tensors by slot, and parameter symbols bound in `params`; on
    the device of env's tensors (an expression free of them is a constant: a CPU scalar).
    `floats`: the dtype of float literals and of floats made from integers (float64 reads the
    tree exactly, as the printer's tests do)."""
    evaluator = _Evaluator(env, tensors, params, _uses(expr), floats)
    return evaluator.run(expr).to(evaluator.device)


def _uses(expr) -> dict:
    """How many times evaluating `expr` asks for each compound node, counted once per distinct
    parent; a Piecewise asks for its branches' conditions and values directly."""
    uses, todo = {}, [expr]
    while todo:
        node = todo.pop()
        args = [a for pair in node.args for a in pair.args] if isinstance(node, sympy.Piecewise) else node.args
        for a in args:
            if a.args:
                seen = uses.get(a, 0)
                uses[a] = seen + 1
                if not seen:
                    todo.append(a)
    return uses


class _Evaluator:
    def __init__(self, env, tensors, params, uses, floats):
        self.env, self.tensors, self.params, self.floats = env, tensors, params, floats
        self.left = uses  # node -> uses still to come, for the nodes used more than once
        self.kept = {}
        # Constants stay 0-d CPU tensors, which torch's elementwise ops take beside tensors on
        # any device as scalars (no copy to the GPU). Only what expands or indexes with them
        # must move them: Max(0, q_idx - 2) and loads at constant indices failed on CUDA.
        self.device = next((v.device for v in env.values()), torch.device("cpu"))

    def run(self, e):
        value = self.kept.get(e)
        if value is not None:
            self.left[e] -= 1
            if not self.left[e]:
                del self.kept[e]
            return value
        value = self._value(e)
        if self.left.get(e, 0) > 1:
            self.kept[e] = value
            self.left[e] -= 1
        return value

    def _value(self, e):
        if e is sympy.true:
            return torch.tensor(True)
        if e is sympy.false:
            return torch.tensor(False)
        if isinstance(e, sympy.Integer):
            return torch.tensor(int(e))
        if isinstance(e, (sympy.Rational, sympy.Float)) or e.is_Number:
            return torch.tensor(float(e), dtype=self.floats)
        if isinstance(e, sympy.Symbol):
            if e in self.env:
                return self.env[e]
            return torch.tensor(self.params[e])
        if e is sympy.pi or e is sympy.E:
            return torch.tensor(float(e), dtype=self.floats)
        method = getattr(self, "_" + type(e).__name__, None)
        if method is None:
            raise NotImplementedError(f"dense evaluation of {type(e).__name__} ({e}) is not implemented")
        return method(e)

    def _floating(self, x):
        """`x` as the kernel's floats compute it: float32 and float64 stay, anything else is
        `floats`."""
        return x if x.dtype in (torch.float32, torch.float64) else x.to(self.floats)

    def _args(self, e):
        return [self.run(a) for a in e.args]

    def _operands(self, e):
        """The arguments of an arithmetic node or a comparison, a float literal among them in
        float64 beside a float64 value: torch takes a Python number in the other operand's dtype,
        and 0.1 read in float32 beside a float64 table had `t64[q] / 5 >= 0.1` false at 0.5 / 5."""
        values = self._args(e)
        if any(v.dtype == torch.float64 for v in values):
            values = [torch.tensor(float(a), dtype=torch.float64) if a.is_Number and not a.is_Integer else v
                      for a, v in zip(e.args, values)]
        return values

    def _Add(self, e):
        first, *rest = self._operands(e)
        for value in rest:
            first = first + value
        return first

    def _Mul(self, e):
        found = quotient(e.args)
        if found is not None:
            return self._divided(found)
        out, *rest = self._operands(e)
        for value in rest:
            out = out * value
        return out

    def _divided(self, found):
        """proxy.quotient's (numerator, denominator, scale), divided as torch and the kernel divide."""
        numerator, denominator = self.run(found[0]), self.run(found[1])
        if not (numerator.is_floating_point() or denominator.is_floating_point()):
            numerator = numerator.to(self.floats)  # torch's integer true division gives the float dtype
        value = torch.true_divide(numerator, denominator)
        return value if found[2] == 1 else value * self.run(found[2])

    def _Pow(self, e):
        # as the printer computes it (codegen/printer.py, _print_Pow): a power proxy.multiplied_out
        # names is the product of its factors, left to right, and a negative one its reciprocal,
        # rounded once; an integer base's reciprocal is torch's true division; roots are correctly
        # rounded
        exp, n = e.exp, multiplied_out(e.exp)
        if n:
            if n < 0 and (e.base.is_integer or integral(e.base)):
                return self._divided(quotient((e,)))
            base = self.run(e.base)
            product = base
            for _ in range(abs(n) - 1):
                product = product * base
            if n > 0:
                return product
            product = self._floating(product)
            return torch.true_divide(torch.ones((), dtype=product.dtype), product)
        if exp.is_Number and abs(float(exp)) == 0.5:
            root = torch.sqrt(self._floating(self.run(e.base)))
            return root if exp > 0 else torch.true_divide(torch.ones((), dtype=root.dtype), root)
        base, exp = self._args(e)
        if e.exp.is_integer and e.exp.is_nonnegative:
            return base**exp  # integers stay integers, as torch's int ** int
        return self._floating(base) ** exp

    def _floor(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den != 1:
            return torch.div(self.run(num), self.run(den), rounding_mode="floor")
        return torch.floor(self.run(e.args[0]))

    def _ceiling(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den != 1:
            return -torch.div(-self.run(num), self.run(den), rounding_mode="floor")
        return torch.ceil(self.run(e.args[0]))

    def _Trunc(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den != 1 and num.is_integer and den.is_integer:
            # exactly: sympy writes (q - kv) / 3 as q/3 - kv/3, whose float value can round below 1
            return torch.div(self.run(num), self.run(den), rounding_mode="trunc")
        x = self.run(e.args[0])
        return torch.trunc(x).to(torch.int64) if x.is_floating_point() else x.to(torch.int64)

    def _Mod(self, e):
        a, b = self._args(e)
        return torch.remainder(a, b)

    def _Min(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = torch.minimum(out, self.run(a))
        return out

    def _Max(self, e):
        out = self.run(e.args[0])
        for a in e.args[1:]:
            out = torch.maximum(out, self.run(a))
        return out

    def _Abs(self, e):
        return torch.abs(self.run(e.args[0]))

    def _sign(self, e):
        return torch.sign(self.run(e.args[0]))

    def _Heaviside(self, e):
        x = self._floating(self.run(e.args[0]))
        at_zero = float(e.args[1]) if len(e.args) > 1 else 0.5
        return torch.where(x > 0, 1.0, torch.where(x == 0, at_zero, 0.0)).to(x.dtype)

    def _exp(self, e):
        return torch.exp(self._floating(self.run(e.args[0])))

    def _log(self, e):
        return torch.log(self._floating(self.run(e.args[0])))

    def _tanh(self, e):
        return torch.tanh(self._floating(self.run(e.args[0])))

    def _atan(self, e):
        return torch.atan(self._floating(self.run(e.args[0])))

    def _sin(self, e):
        return torch.sin(self._floating(self.run(e.args[0])))

    def _cos(self, e):
        return torch.cos(self._floating(self.run(e.args[0])))

    def _erf(self, e):
        return torch.erf(self._floating(self.run(e.args[0])))

    def _Float16(self, e):
        return self.run(e.args[0]).to(torch.float32).to(torch.float16).to(torch.float32)

    def _BFloat16(self, e):
        return self.run(e.args[0]).to(torch.float32).to(torch.bfloat16).to(torch.float32)

    def _CustomBackward(self, e):
        return self.run(e.value)

    def _BitAnd(self, e):
        return torch.bitwise_and(*self._integers(e))

    def _BitOr(self, e):
        return torch.bitwise_or(*self._integers(e))

    def _BitXor(self, e):
        return torch.bitwise_xor(*self._integers(e))

    def _LeftShift(self, e):
        return torch.bitwise_left_shift(*self._integers(e))

    def _RightShift(self, e):
        return torch.bitwise_right_shift(*self._integers(e))

    def _integers(self, e):
        return [v.to(torch.int64) for v in self._args(e)]

    def _Piecewise(self, e):
        out = self.run(e.args[-1].expr)
        for branch in reversed(e.args[:-1]):
            out = torch.where(self.run(branch.cond), self.run(branch.expr), out)
        return out

    def _GreaterThan(self, e):
        a, b = self._operands(e)
        return a >= b

    def _StrictGreaterThan(self, e):
        a, b = self._operands(e)
        return a > b

    def _LessThan(self, e):
        a, b = self._operands(e)
        return a <= b

    def _StrictLessThan(self, e):
        a, b = self._operands(e)
        return a < b

    def _Equality(self, e):
        a, b = self._operands(e)
        return a == b

    def _Unequality(self, e):
        a, b = self._operands(e)
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

    def _ITE(self, e):
        cond, a, b = self._args(e)
        return torch.where(cond, a, b)

    def _load(self, e):
        tensor = self.tensors[int(e.args[0])]
        # indices beside the tensor: a constant index is a CPU scalar
        index = [self.run(i).to(self.device) for i in e.args[1:]]
        if not index:  # a 0-d tensor's one element
            return self._widened(tensor.to(self.device).reshape(()))
        inside = True
        clamped = []
        for dim, i in enumerate(torch.broadcast_tensors(*index)):
            i = torch.where(i < 0, i + tensor.shape[dim], i)  # from the end, as torch indexes
            inside = inside & (i >= 0) & (i < tensor.shape[dim])
            clamped.append(i.clamp(0, tensor.shape[dim] - 1).to(torch.long))
        value = self._widened(tensor.to(self.device)[tuple(clamped)])
        return torch.where(inside, value, torch.zeros((), dtype=value.dtype, device=value.device))

    def _widened(self, value):
        # as the kernel's loads read (_widen): integers as int64, so that arithmetic on them
        # never wraps; float16 and bfloat16 as float32
        return self._floating(value) if value.dtype.is_floating_point else value.to(torch.int64)

    _LoadInt = _LoadFloat = _LoadBool = _load


def symbols_env(b, h, q_idx, kv_idx, score=None) -> dict:
    env = {B: b, H: h, Q_IDX: q_idx, KV_IDX: kv_idx}
    if score is not None:
        env[SCORE] = score
    return env


