"""Print traced expressions as Triton expressions that keep Python's and torch's semantics.

One `_print_<Node>` per sympy node; anything else is an error (strict). Every compound is
parenthesised: the output is read by Triton, not by people, and precedence mistakes are
silent wrong answers.

- `//` and `%` follow Python (floor, divisor's sign). When sympy can prove the dividend
  nonnegative and the divisor a positive literal, the plain operators agree with Python
  and are printed; otherwise the helpers `_floordiv` / `_mod` / `_ceildiv` of the template.
- Integer-valued true division stays true division (`/` of a Rational prints a float).
- Captured-tensor loads are masked to the tensor's bounds (an index out of range reads 0)
  and widened where they are read, by the template's `_widen`: float16/bfloat16 to float32,
  int8/int16/uint8 (and bool) to int32, so that no arithmetic runs in a narrow type.
- Positions meet floats in float: a sum of ±q_idx, ±kv_idx and integer literals inside a
  float expression (ALiBi's `(kv_idx - q_idx) * slope`) is printed over `q_idx_f`/`kv_idx_f`,
  the position vectors converted once per tile, instead of converting every element of the
  tile (an int-to-float conversion runs at a quarter of the FMA rate on Hopper). Exact while
  positions stay below 2^24; a sum of two terms rounds once either way. Integer arguments
  of float functions (exp, sin, 2**x, ...) are converted the same way, as torch does.
- A function of numbers alone (exp(3), 1/sqrt(pi) in erf's derivative) is printed as its
  float value: Triton's math functions take tensors, not Python numbers.
- torch's integer operations: `&`, `|`, `^` as Triton's; shifts through `_lshift` /
  `_rshift`, in int64 with torch's rule for shift counts past the width (0, or the sign);
  Trunc (`.long()`) converts to int64, rounding toward zero.
- sign(0) = 0 (torch.sign); Heaviside(x, h0) takes the value h0 at 0 (sympy's argument).
  DiracDelta and Derivative are refused with the reason: maskc differentiates score mods
  itself (render.score_derivative), where steps have derivative 0 as in torch.

Shared subexpressions: nested torch.where builds expressions whose subexpressions repeat, so
that the tree is exponentially larger than the number of distinct nodes. `block` prints a
subexpression whose text is needed more than once as one statement `_name0 = ...` and uses
the name after it; text needed once stays inline, so simple masks print as they read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice

import sympy
from sympy.printing.codeprinter import CodePrinter

from maskc.trace.symbols import B, H, KV_IDX, Q_IDX, SCORE

_NAMES = {B: "off_b", H: "off_h", Q_IDX: "q_idx", KV_IDX: "kv_idx", SCORE: "score"}
_FLOAT_POSITIONS = {Q_IDX: "q_idx_f", KV_IDX: "kv_idx_f"}
# A shared subexpression this short (a name, a literal, one operation on names) is repeated
# rather than named: reading it costs less than looking up a statement.
_INLINE_CHARS = 24


@dataclass(frozen=True)
class Printed:
    """Triton text of an expression: statements to run first, then its value."""

    statements: tuple[str, ...]
    value: str


class TritonPrinter(CodePrinter):
    """`TritonPrinter().doprint(expr)` -> Triton source text for `expr`, all of it inline
    (exponentially long for deeply shared subexpressions: kernels are printed by `block`).

    >>> TritonPrinter().doprint(sympy.floor((Q_IDX - KV_IDX) / 3))
    '_floordiv((q_idx + (-1 * kv_idx)), 3)'
    """

    printmethod = "_tritoncode"
    language = "Triton"
    _default_settings = {**CodePrinter._default_settings, "strict": True, "human": True}

    def __init__(self):
        super().__init__()
        self._reset(counts=None, uses={}, prefix="")

    def _reset(self, counts, uses, prefix):
        self._counts = counts  # while counting: how often each node's text is asked for
        self._uses = uses  # while printing: those counts
        self._prefix = prefix
        self._done = {}  # node -> its text or statement name
        self._statements = []

    def doprint(self, expr, assign_to=None) -> str:
        self._reset(counts=None, uses={}, prefix="")
        return self._print(expr)

    def block(self, exprs, prefix: str) -> list[Printed]:
        """Triton text of each of `exprs`, for code that runs them in order in one scope.

        A subexpression needed more than once, within one expression or across them, is
        printed once as a statement `{prefix}N = ...` before its first use, unless its text is
        short enough to repeat; everything else stays inline. "Needed" counts what the printing
        rules ask for (x twice in x**2), so the rules run once over everything to count first.

        >>> x = sympy.tanh(SCORE / 30)
        >>> TritonPrinter().block([30 * x, 1 - x**2], "_score")
        [Printed(statements=('_score0 = _tanh((0.03333333333333333 * score))',), value='(30 * _score0)'),
         Printed(statements=(), value='(1 + (-1 * (_score0 * _score0)))')]
        """
        self._reset(counts={}, uses={}, prefix=prefix)
        for e in exprs:
            self._print(e)
        self._reset(counts=None, uses=self._counts, prefix=prefix)
        out = []
        for e in exprs:
            start = len(self._statements)
            value = self._print(e)
            out.append(Printed(tuple(self._statements[start:]), value))
        return out

    def _print(self, expr, **kwargs):
        if self._counts is not None:
            seen = self._counts.get(expr, 0)
            self._counts[expr] = seen + 1
            return self._rule(expr) if not seen else "_"
        text = self._done.get(expr)
        if text is None:
            text = self._rule(expr)
            if self._uses.get(expr, 0) > 1 and len(text) > _INLINE_CHARS and self._prefix:
                name = f"{self._prefix}{len(self._statements)}"
                self._statements.append(f"{name} = {text}")
                text = name
            self._done[expr] = text
        return text

    def _rule(self, expr):
        if isinstance(expr, (sympy.Function, sympy.Pow)) and not expr.is_Atom and expr.is_number:
            value = expr.evalf(30)  # more digits than a float64 has, so that it rounds once
            if value.is_Float:
                return repr(float(value))
        # Only our own rules: sympy's generic fallbacks would print names Triton cannot run.
        for cls in type(expr).__mro__:
            rule = TritonPrinter.__dict__.get(f"_print_{cls.__name__}")
            if rule is not None:
                return rule(self, expr)
        raise ValueError(f"maskc cannot print {type(expr).__name__} ({describe(expr, 40)}) for Triton; "
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

    def _print_NaN(self, e):
        return 'float("nan")'

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

    def _float(self, e):
        """Text of `e` as a float: an integer expression is converted, as torch's float
        functions convert integer tensors."""
        if not e.is_integer:
            return self._print(e)
        if e.is_Number:
            return repr(float(e))
        if _position_sum(e):
            return self._float_positions(e)
        return f"({self._print(e)}).to(tl.float32)"

    def _print_Pow(self, e):
        base, exp = e.args
        # score**2.0 is score * score, as in torch; past 64 factors, the general rule below
        if exp.is_Number and exp.is_finite and float(exp).is_integer() and abs(float(exp)) <= 64:
            n = int(exp)
            if n == 0:
                return "1"
            text = " * ".join([self._print(base)] * abs(n))
            return f"({text})" if n > 0 else f"(1.0 / ({text}))"
        if exp.is_Number and float(exp) == 0.5:
            return f"tl.sqrt({self._float(base)})"
        if exp.is_Number and float(exp) == -0.5:
            return f"(1.0 / tl.sqrt({self._float(base)}))"
        if base.is_Number and float(base) == 2.0:
            return f"tl.math.exp2({self._float(exp)})"
        if base.is_Number and base > 0:
            return f"tl.math.exp2({math.log2(base)!r} * {self._float(exp)})"
        return f"tl.exp({self._float(exp)} * tl.log({self._float(base)}))"

    def _print_floor(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den == 1:
            return f"tl.floor({self._print(e.args[0])})"
        if not (num.is_integer and den.is_integer):
            return f"tl.floor({self._print(num)} / {self._print(den)})"
        if num.is_nonnegative and den.is_Integer and den > 0:
            return f"({self._print(num)} // {self._print(den)})"
        return f"_floordiv({self._print(num)}, {self._print(den)})"

    def _print_ceiling(self, e):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den == 1:
            return f"tl.ceil({self._print(e.args[0])})"
        if not (num.is_integer and den.is_integer):
            return f"tl.ceil({self._print(num)} / {self._print(den)})"
        return f"_ceildiv({self._print(num)}, {self._print(den)})"

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

    def _print_sign(self, e):
        return f"_sign({self._print(e.args[0])})"

    def _print_Heaviside(self, e):
        x = self._print(e.args[0])
        at_zero = e.args[1] if len(e.args) > 1 else sympy.Rational(1, 2)
        if at_zero.is_Number and float(at_zero) == 1.0:
            return f"tl.where({x} >= 0, 1.0, 0.0)"
        if at_zero.is_Number and float(at_zero) == 0.0:
            return f"tl.where({x} > 0, 1.0, 0.0)"
        return f"tl.where({x} > 0, 1.0, tl.where({x} == 0, {self._print(at_zero)}, 0.0))"

    def _print_exp(self, e):
        return f"tl.exp({self._float(e.args[0])})"

    def _print_log(self, e):
        return f"tl.log({self._float(e.args[0])})"

    def _print_tanh(self, e):
        return f"_tanh({self._float(e.args[0])})"

    def _print_sin(self, e):
        return f"tl.sin({self._float(e.args[0])})"

    def _print_cos(self, e):
        return f"tl.cos({self._float(e.args[0])})"

    def _print_erf(self, e):
        return f"tl.math.erf({self._float(e.args[0])})"

    def _print_Piecewise(self, e):
        out = self._print(e.args[-1].expr)
        if e.args[-1].cond is not sympy.true:
            raise ValueError(f"Piecewise {describe(e, 40)} has no default branch; "
                             f"build it with torch.where(cond, a, b)")
        for branch in reversed(e.args[:-1]):
            out = f"tl.where({self._print(branch.cond)}, {self._print(branch.expr)}, {out})"
        return out

    def _print_DiracDelta(self, e):
        raise ValueError(f"maskc cannot print DiracDelta ({describe(e, 40)}), the derivative of a step: maskc "
                         f"takes the derivative of sign and Heaviside as 0, as torch does; differentiate with "
                         f"maskc.codegen.render.score_derivative, not sympy.diff")

    def _print_Derivative(self, e):
        raise ValueError(f"maskc cannot print Derivative ({describe(e, 40)}): the expression has no derivative there; "
                         f"differentiate with maskc.codegen.render.score_derivative, which says where")

    # -- integer operations (maskc/trace/symbols.py) ------------------------------------------
    def _print_BitAnd(self, e):
        return f"({self._print(e.args[0])} & {self._print(e.args[1])})"

    def _print_BitOr(self, e):
        return f"({self._print(e.args[0])} | {self._print(e.args[1])})"

    def _print_BitXor(self, e):
        return f"({self._print(e.args[0])} ^ {self._print(e.args[1])})"

    def _print_LeftShift(self, e):
        return f"_lshift({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _print_RightShift(self, e):
        return f"_rshift({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _print_Trunc(self, e):
        if e.args[0].is_Number:
            return str(int(e.args[0]))
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if den != 1 and num.is_integer and den.is_integer:
            # an integer quotient toward zero, exactly: sympy writes (q - kv) / 3 as q/3 - kv/3,
            # whose float value can round below the integer it equals
            return f"_truncdiv({self._print(num)}, {self._print(den)})"
        return f"({self._print(e.args[0])}).to(tl.int64)"

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

    def _print_ITE(self, e):
        return f"tl.where({self._print(e.args[0])}, {self._print(e.args[1])}, {self._print(e.args[2])})"

    # -- captured tensors ---------------------------------------------------------------------
    def _print_load(self, e):
        slot = int(e.args[0])
        index = [self._print(i) for i in e.args[1:]]
        name = f"T{slot}"
        if not index:
            return f"_widen(tl.load({name}))"
        offset = " + ".join(f"({i}) * {name}_stride{d}" for d, i in enumerate(index))
        inside = " & ".join(f"(({i}) >= 0) & (({i}) < {name}_size{d})" for d, i in enumerate(index))
        # `!= 0`: Triton's interpreter gives `scalar_bool & block_bool` a dtype tl.load refuses
        return f"_widen(tl.load({name} + {offset}, mask=({inside}) != 0, other=0))"

    _print_LoadInt = _print_LoadFloat = _print_LoadBool = _print_load


def _position_sum(e) -> bool:
    """Whether `e` is ±q_idx, ±kv_idx and integer literals summed, with a position in it."""
    terms = e.args if e.is_Add else (e,)
    return all(_position_term(t) or (t.is_Integer and abs(int(t)) < 2**24) for t in terms) and any(
        _position_term(t) for t in terms)


def _position_term(t) -> bool:
    return t in _FLOAT_POSITIONS or (t.is_Mul and len(t.args) == 2 and t.args[0] == -1
                                     and t.args[1] in _FLOAT_POSITIONS)


def describe(expr, limit: int = 400) -> str:
    """str(expr) for people (comments, error messages), or a summary when its tree is large:
    str walks the tree, exponentially larger than the expression for nested torch.where."""
    if sum(1 for _ in islice(sympy.preorder_traversal(expr), limit + 1)) <= limit:
        return str(expr)
    return f"{type(expr).__name__}(...), over {limit} subexpressions as a tree"


def tensor_args(slot: int, rank: int) -> list[str]:
    """Kernel argument names for captured tensor `slot`: pointer, then strides and sizes."""
    name = f"T{slot}"
    return [name] + [f"{name}_stride{d}" for d in range(rank)] + [f"{name}_size{d}" for d in range(rank)]


__all__ = ["Printed", "TritonPrinter", "describe", "tensor_args"]
