"""Print traced expressions as Triton expressions that keep Python's semantics.

One `_print_<Node>` per sympy node; anything else is an error (strict). Every compound is
parenthesised: the output is read by Triton, not by people, and precedence mistakes are
silent wrong answers.

- `//` and `%` follow Python (floor, divisor's sign). When sympy can prove the dividend
  nonnegative and the divisor a positive literal, the plain operators agree with Python
  and are printed; otherwise the helpers `_floordiv` / `_mod` of the template are used.
- Integer-valued true division stays true division (`/` of a Rational prints a float).
- Captured-tensor loads are masked to the tensor's bounds: an index out of range reads 0.
- Positions meet floats in float: a sum of ±q_idx, ±kv_idx and integer literals inside a
  float expression (ALiBi's `(kv_idx - q_idx) * slope`) is printed over `q_idx_f`/`kv_idx_f`,
  the position vectors converted once per tile, instead of converting every element of the
  tile (an int-to-float conversion runs at a quarter of the FMA rate on Hopper). Exact while
  positions stay below 2^24; a sum of two terms rounds once either way.
"""
from __future__ import annotations

import sympy
from sympy.printing.codeprinter import CodePrinter

from maskc.trace.symbols import B, H, KV_IDX, Q_IDX, SCORE

_NAMES = {B: "off_b", H: "off_h", Q_IDX: "q_idx", KV_IDX: "kv_idx", SCORE: "score"}
_FLOAT_POSITIONS = {Q_IDX: "q_idx_f", KV_IDX: "kv_idx_f"}


class TritonPrinter(CodePrinter):
    """`TritonPrinter().doprint(expr)` -> Triton source text for `expr`.

    >>> TritonPrinter().doprint(sympy.floor((Q_IDX - KV_IDX) / 3))
    '_floordiv((q_idx + (-1 * kv_idx)), 3)'
    """

    printmethod = "_tritoncode"
    language = "Triton"
    _default_settings = {**CodePrinter._default_settings, "strict": True, "human": True}

    def __init__(self, tensor_ranks: dict[int, int] | None = None):
        super().__init__()
        self.tensor_ranks = tensor_ranks or {}

    def doprint(self, expr, assign_to=None):
        return self._print(expr)

    def _print(self, expr, **kwargs):
        # Only our own rules: sympy's generic fallbacks would print names Triton cannot run.
        for cls in type(expr).__mro__:
            rule = TritonPrinter.__dict__.get(f"_print_{cls.__name__}")
            if rule is not None:
                return rule(self, expr)
        raise ValueError(f"maskc cannot print {type(expr).__name__} ({expr}) for Triton; "
                         f"add a _print_{type(expr).__name__} rule to maskc/codegen/printer.py")

    # -- atoms --------------------------------------------------------------------------------
    def _print_Symbol(self, e):
        return _NAMES.get(e, e.name)

    def _print_Integer(self, e):
        return str(int(e))

    _print_Zero = _print_One = _print_NegativeOne = _print_Integer

    def _print_Rational(self, e):
        return repr(float(e))

    _print_Half = _print_Rational

    def _print_Float(self, e):
        return repr(float(e))

    def _print_Infinity(self, e):
        return 'float("inf")'

    def _print_NegativeInfinity(self, e):
        return 'float("-inf")'

    def _print_BooleanTrue(self, e):
        return "True"

    def _print_BooleanFalse(self, e):
        return "False"

    def _print_Exp1(self, e):
        return repr(float(sympy.E))

    def _print_Pi(self, e):
        return repr(float(sympy.pi))

    # -- arithmetic ---------------------------------------------------------------------------
    def _print_Add(self, e):
        return "(" + " + ".join(self._operands(e)) + ")"

    def _print_Mul(self, e):
        return "(" + " * ".join(self._operands(e)) + ")"

    def _operands(self, e):
        if e.is_integer:
            return [self._print(a) for a in e.args]
        return [self._float_positions(a) if _position_sum(a) else self._print(a) for a in e.args]

    def _float_positions(self, e):
        if e in _FLOAT_POSITIONS:
            return _FLOAT_POSITIONS[e]
        if e.is_Integer:
            return repr(float(e))
        if e.is_Mul:  # -1 * position
            return f"(-1.0 * {_FLOAT_POSITIONS[e.args[1]]})"
        return "(" + " + ".join(self._float_positions(a) for a in e.args) + ")"

    def _print_Pow(self, e):
        base, exp = e.args
        if exp.is_Integer:
            n = int(exp)
            if n == 0:
                return "1"
            text = " * ".join([self._print(base)] * abs(n))
            return f"({text})" if n > 0 else f"(1.0 / ({text}))"
        if exp == sympy.Rational(1, 2):
            return f"tl.sqrt({self._print(base)})"
        if exp == sympy.Rational(-1, 2):
            return f"(1.0 / tl.sqrt({self._print(base)}))"
        return f"tl.exp({self._print(exp)} * tl.log({self._print(base)}))"

    def _print_floor(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den == 1:
            return f"tl.floor({self._print(e.args[0])})"
        if not (num.is_integer and den.is_integer):
            return f"tl.floor({self._print(num)} / {self._print(den)})"
        if num.is_nonnegative and den.is_Integer and den > 0:
            return f"({self._print(num)} // {self._print(den)})"
        return f"_floordiv({self._print(num)}, {self._print(den)})"

    def _print_Mod(self, e):
        a, m = e.args
        if not (a.is_integer and m.is_integer):
            return f"({self._print(a)} - {self._print(m)} * tl.floor({self._print(a)} / {self._print(m)}))"
        if a.is_nonnegative and m.is_Integer and m > 0:
            return f"({self._print(a)} % {self._print(m)})"
        return f"_mod({self._print(a)}, {self._print(m)})"

    def _fold(self, fn, e):
        out = self._print(e.args[0])
        for a in e.args[1:]:
            out = f"{fn}({out}, {self._print(a)})"
        return out

    def _print_Min(self, e):
        return self._fold("tl.minimum", e)

    def _print_Max(self, e):
        return self._fold("tl.maximum", e)

    def _print_Abs(self, e):
        return f"tl.abs({self._print(e.args[0])})"

    def _print_exp(self, e):
        return f"tl.exp({self._print(e.args[0])})"

    def _print_log(self, e):
        return f"tl.log({self._print(e.args[0])})"

    def _print_tanh(self, e):
        return f"_tanh({self._print(e.args[0])})"

    def _print_Piecewise(self, e):
        out = self._print(e.args[-1].expr)
        if e.args[-1].cond is not sympy.true:
            raise ValueError(f"Piecewise {e} has no default branch; build it with torch.where(cond, a, b)")
        for branch in reversed(e.args[:-1]):
            out = f"tl.where({self._print(branch.cond)}, {self._print(branch.expr)}, {out})"
        return out

    # -- logic --------------------------------------------------------------------------------
    def _relation(self, e, op):
        return f"({self._print(e.lhs)} {op} {self._print(e.rhs)})"

    def _print_GreaterThan(self, e):
        return self._relation(e, ">=")

    def _print_StrictGreaterThan(self, e):
        return self._relation(e, ">")

    def _print_LessThan(self, e):
        return self._relation(e, "<=")

    def _print_StrictLessThan(self, e):
        return self._relation(e, "<")

    def _print_Equality(self, e):
        return self._relation(e, "==")

    def _print_Unequality(self, e):
        return self._relation(e, "!=")

    def _print_And(self, e):
        return "(" + " & ".join(self._print(a) for a in e.args) + ")"

    def _print_Or(self, e):
        return "(" + " | ".join(self._print(a) for a in e.args) + ")"

    def _print_Xor(self, e):
        return "(" + " ^ ".join(self._print(a) for a in e.args) + ")"

    def _print_Not(self, e):
        return f"(~{self._print(e.args[0])})"

    # -- captured tensors ---------------------------------------------------------------------
    def _print_load(self, e):
        slot = int(e.args[0])
        index = [self._print(i) for i in e.args[1:]]
        name = f"T{slot}"
        if not index:
            return f"tl.load({name})"
        offset = " + ".join(f"({i}) * {name}_stride{d}" for d, i in enumerate(index))
        inside = " & ".join(f"(({i}) >= 0) & (({i}) < {name}_size{d})" for d, i in enumerate(index))
        # `!= 0`: Triton's interpreter gives `scalar_bool & block_bool` a dtype tl.load refuses
        return f"tl.load({name} + {offset}, mask=({inside}) != 0, other=0)"

    _print_LoadInt = _print_LoadFloat = _print_LoadBool = _print_load


def _position_sum(e) -> bool:
    """Whether `e` is ±q_idx, ±kv_idx and integer literals summed, with a position in it."""
    terms = e.args if e.is_Add else (e,)
    return all(_position_term(t) or (t.is_Integer and abs(int(t)) < 2**24) for t in terms) and any(
        _position_term(t) for t in terms)


def _position_term(t) -> bool:
    return t in _FLOAT_POSITIONS or (t.is_Mul and len(t.args) == 2 and t.args[0] == -1
                                     and t.args[1] in _FLOAT_POSITIONS)


def tensor_args(slot: int, rank: int) -> list[str]:
    """Kernel argument names for captured tensor `slot`: pointer, then strides and sizes."""
    name = f"T{slot}"
    return [name] + [f"{name}_stride{d}" for d in range(rank)] + [f"{name}_size{d}" for d in range(rank)]


__all__ = ["TritonPrinter", "tensor_args"]
