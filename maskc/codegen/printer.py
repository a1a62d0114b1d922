"""Print traced expressions as Triton expressions that keep Python's and torch's semantics.

One `_print_<Node>` per sympy node; anything else is an error (strict).

Parentheses follow Python's precedence, as Triton parses the text with Python's parser: each
rule returns its text with the precedence of its outermost operator, and an operand is
parenthesised only where it binds looser than its operator needs (`_Prec`). Sums and
products are chained left to right in sympy's argument order, as they were evaluated when
every compound was parenthesised, and a term with a negative coefficient is subtracted
(`a - 2 * b` for a + (-2) * b, which IEEE arithmetic and integer wraparound round alike).
A precedence mistake is a silent wrong answer: tests/test_printer.py evaluates the printed
text of random expressions as Python and compares it with maskc's dense evaluation of the tree.

- `//` and `%` follow Python (floor, divisor's sign). When sympy can prove the dividend
  nonnegative and the divisor a positive literal, the plain operators agree with Python
  and are printed; otherwise the helpers `_floordiv` / `_mod` / `_ceildiv` of the template.
- What is an integer is sympy's verdict, or where sympy cannot tell, the tracer's dtype
  (`maskc.trace.proxy.integral`): floor(q_idx / p0) is an integer to torch, while sympy
  allows p0 = 0. floor and ceil of a float print as tl.floor / tl.ceil, a float to Triton;
  where Triton needs an integer (a pointer offset, `//`, `&`) it is converted to int64, the
  `.long()` torch needed there and the trace keeps no node for.
- Integer-valued true division stays true division (`/` of a Rational prints a float). A
  product with non-literal divisors is one division, as torch's x / d: of index arithmetic,
  float32 and correctly rounded (`tl.math.div_rn`); of a score or captured float element by
  integers, `/` in its dtype (`_division`).
- Captured-tensor loads count a negative index from the end (torch's t[-1]), are masked to
  the tensor's bounds (an index still out of range reads 0) and widened where they are read,
  by the template's `_widen`: float16/bfloat16 to float32, int8/int16/uint8 (and bool) to
  int32, so that no arithmetic runs in a narrow type.
- Positions meet floats in float: a sum of ±q_idx, ±kv_idx and integer literals inside a
  float expression (ALiBi's `(kv_idx - q_idx) * slope`) is printed over `q_idx_f`/`kv_idx_f`,
  the position vectors converted once per tile, instead of converting every element of the
  tile (an int-to-float conversion runs at a quarter of the FMA rate on Hopper). Exact while
  positions stay below 2^24; a sum of two terms rounds once either way. Integer arguments
  of float functions (exp, sin, 2**x, ...) are converted the same way, as torch does.
  Products and powers of positions inside a float expression are computed in float too:
  the trace keeps no casts, and `(q_idx - kv_idx).float() ** 3` printed over int32
  positions wraps past a difference of 1290 (the GPU check's arctangent mod at 4097 rows).
- A function of numbers alone (exp(3), 1/sqrt(pi) in erf's derivative) is printed as its
  float value: Triton's math functions take tensors, not Python numbers.
- torch's integer operations: `&`, `|`, `^` as Triton's; shifts through `_lshift` /
  `_rshift`, in int64 with torch's rule for shift counts past the width (0, or the sign);
  Trunc (`.long()`) converts to int64, rounding toward zero.
- A float cast to float16 or bfloat16 inside a mod is rounded and read back (`_rounded`).
- A condition free of q_idx and kv_idx, which may be 0-d, is compared with 0 where `&`, `|`
  or `^` join it to others (`_condition`: Triton's interpreter).
- sign(0) = 0 (torch.sign); Heaviside(x, h0) takes the value h0 at 0 (sympy's argument).
  DiracDelta and Derivative are refused with the reason: maskc differentiates score mods
  itself (render.score_derivative), where steps have derivative 0 as in torch.

The template's helpers a printer called, with the helpers they call, are in `helpers`: a
generated file defines only those.

Shared subexpressions: nested torch.where builds expressions whose subexpressions repeat, so
that the tree is exponentially larger than the number of distinct nodes. `block` prints a
subexpression whose text is needed more than once as one statement `_name0 = ...` and uses
the name after it; text needed once stays inline, so simple masks print as they read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from itertools import islice
from typing import NamedTuple

import sympy
from sympy.printing.codeprinter import CodePrinter

from maskc.trace import dag
from maskc.trace.proxy import integral, multiplied_out, quotient
from maskc.trace.symbols import B, H, KV_IDX, Q_IDX, SCORE, LoadBool, LoadFloat, LoadInt

_NAMES = {B: "off_b", H: "off_h", Q_IDX: "q_idx", KV_IDX: "kv_idx", SCORE: "score"}
_FLOAT_POSITIONS = {Q_IDX: "q_idx_f", KV_IDX: "kv_idx_f"}
# the positions as real symbols, so that a polynomial in them prints as float arithmetic
_FLOAT_SYMBOLS = {position: sympy.Symbol(name, real=True) for position, name in _FLOAT_POSITIONS.items()}
# A shared subexpression this short (a name, a literal, one operation on names) is repeated
# rather than named: reading it costs less than looking up a statement.
_INLINE_CHARS = 24
# The template's helpers that call other helpers (templates/_prelude.py.jinja).
_HELPER_CALLS = {"_ceildiv": ("_floordiv",), "_truncdiv": ("_floordiv",)}


class _Prec(IntEnum):
    """Python's precedence of the operators the printer writes, loosest first. Comparisons
    are looser than `|`, `^` and `&` (`a & b == 0` is `(a & b) == 0`) and chain (`a < b < c`
    is two comparisons), so a comparison that is an operand of one is parenthesised too."""

    COMPARE = 1
    OR = 2
    XOR = 3
    AND = 4
    ADD = 5  # + -
    MUL = 6  # * / // %
    UNARY = 7  # -x ~x
    ATOM = 8  # names, literals, calls


class _Text(NamedTuple):
    """Printed text and the precedence of its outermost operator."""

    text: str
    prec: _Prec

    def operand(self, prec: int) -> str:
        """The text as an operand that must bind at least as tightly as `prec`: for a
        left-associative operator at precedence P, P on its left and P + 1 on its right."""
        return self.text if self.prec >= prec else f"({self.text})"


def _atom(text: str) -> _Text:
    return _Text(text, _Prec.ATOM)


def _literal(text: str) -> _Text:
    return _Text(text, _Prec.UNARY if text.startswith("-") else _Prec.ATOM)


def _join(texts, op: str, prec: _Prec) -> _Text:
    """`a op b op c`, evaluated left to right as Python does; one text is returned as it is."""
    first, *rest = texts
    if not rest:
        return first
    return _Text(" ".join([first.operand(prec), *(f"{op} {t.operand(prec + 1)}" for t in rest)]), prec)


def _attribute_of(t: _Text) -> str:
    """`t` as the object of an attribute (`x.to(...)`); a number needs parentheses too (`3.to`)."""
    return t.text if t.prec == _Prec.ATOM and not t.text[0].isdigit() else f"({t.text})"


def _quotient(e):
    """(numerator, denominator) of `e` over one denominator: (q_idx - kv_idx, 3) for
    q_idx/3 - kv_idx/3. Not sympy.together: it rebuilds a product with evaluation, which
    distributes a rational coefficient over a sum again, so that -1/2 * (p0 + q_idx) (an
    unevaluated -(p0 + q_idx) divided by 2) came back as -p0/2 - q_idx/2 over 1, and an integer
    quotient printed as a float division."""
    return e.as_numer_denom()


@dataclass(frozen=True)
class Printed:
    """Triton text of an expression: statements to run first, then its value."""

    statements: tuple[str, ...]
    value: str

    @property
    def names(self) -> tuple[str, ...]:
        """The names the statements define, for code in another scope that reads them."""
        return tuple(statement.split(" = ", 1)[0] for statement in self.statements)


class TritonPrinter(CodePrinter):
    """`TritonPrinter().doprint(expr)` -> Triton source text for `expr`, all of it inline
    (exponentially long for deeply shared subexpressions: kernels are printed by `block`).
    `helpers` holds the names of the template's helpers that the printed text calls, with the
    helpers those call.

    >>> TritonPrinter().doprint(sympy.floor((Q_IDX - KV_IDX) / 3))
    '_floordiv(q_idx - kv_idx, 3)'
    """

    printmethod = "_tritoncode"
    language = "Triton"
    _default_settings = {**CodePrinter._default_settings, "strict": True, "human": True}

    def __init__(self, negative_indices: bool = True, decides: bool = True):
        super().__init__()
        self.helpers: set[str] = set()
        # False: the caller knows every captured-tensor index is nonnegative where the kernel runs
        self.negative_indices = negative_indices
        # Whether the expressions printed decide on floats (a mask; a score mod with a float
        # comparison or rounding: codegen.source.fuses_multiply_add): their reciprocals, roots
        # and captured elements' quotients then round as torch's. A score's value does not need
        # it and keeps the GPU's faster forms.
        self.decides = decides
        # id -> (node, whether it reads q_idx or kv_idx), for _condition; the node is held so
        # that its id stays its own
        self._reads_positions: dict[int, tuple] = {}
        self._reset(counts=None, uses={}, prefix="")

    def _reset(self, counts, uses, prefix, exprs=()):
        self._wide = _arithmetic_loads(exprs)
        self._counts = counts  # while counting: how often each node's text is asked for
        self._uses = uses  # while printing: those counts
        self._prefix = prefix
        self._done = {}  # node -> its _Text, or that of its statement's name
        self._statements = []

    def doprint(self, expr, assign_to=None) -> str:
        self._reset(counts=None, uses={}, prefix="", exprs=(expr,))
        return self._print(expr)

    def block(self, exprs, prefix: str) -> list[Printed]:
        """Triton text of each of `exprs`, for code that runs them in order in one scope.

        A subexpression needed more than once, within one expression or across them, is
        printed once as a statement `{prefix}N = ...` before its first use, unless its text is
        short enough to repeat; everything else stays inline. "Needed" counts what the printing
        rules ask for (x twice in x**2), so the rules run once over everything to count first.

        >>> x = sympy.tanh(SCORE / 30)
        >>> TritonPrinter().block([30 * x, 1 - x**2], "_score")
        [Printed(statements=('_score0 = _tanh(0.03333333333333333 * score)',), value='30 * _score0'),
         Printed(statements=(), value='1 - _score0 * _score0')]
        """
        self._reset(counts={}, uses={}, prefix=prefix, exprs=exprs)
        for e in exprs:
            self._text(e)
        self._reset(counts=None, uses=self._counts, prefix=prefix, exprs=exprs)
        out = []
        for e in exprs:
            start = len(self._statements)
            value = self._print(e)
            out.append(Printed(tuple(self._statements[start:]), value))
        return out

    def _print(self, expr, **kwargs) -> str:
        return self._text(expr).text

    def _text(self, expr) -> _Text:
        if self._counts is not None:
            seen = self._counts.get(expr, 0)
            self._counts[expr] = seen + 1
            return self._rule(expr) if not seen else _atom("_")
        text = self._done.get(expr)
        if text is None:
            text = self._rule(expr)
            if self._uses.get(expr, 0) > 1 and len(text.text) > _INLINE_CHARS and self._prefix:
                name = f"{self._prefix}{len(self._statements)}"
                self._statements.append(f"{name} = {text.text}")
                text = _atom(name)
            self._done[expr] = text
        return text

    def _rule(self, expr) -> _Text:
        if isinstance(expr, (sympy.Function, sympy.Pow)) and not expr.is_Atom and expr.is_number:
            value = expr.evalf(30)  # more digits than a float64 has, so that it rounds once
            if value.is_Float:
                return _literal(repr(float(value)))
        # Only our own rules: sympy's generic fallbacks would print names Triton cannot run.
        for cls in type(expr).__mro__:
            rule = TritonPrinter.__dict__.get(f"_print_{cls.__name__}")
            if rule is not None:
                return rule(self, expr)
        raise ValueError(f"maskc cannot print {type(expr).__name__} ({describe(expr, 40)}) for Triton; "
                         f"add a _print_{type(expr).__name__} rule to maskc/codegen/printer.py")

    def _helper(self, name: str, *args: str) -> _Text:
        """A call of the template's helper `name`, which the generated file must then define."""
        self.helpers.update((name, *_HELPER_CALLS.get(name, ())))
        return _atom(f"{name}({', '.join(args)})")

    def _binary(self, a, op: str, b, prec: _Prec) -> _Text:
        return _join([self._text(a), self._text(b)], op, prec)

    # -- atoms --------------------------------------------------------------------------------
    def _print_Symbol(self, e):
        return _atom(_NAMES.get(e, e.name))

    def _print_Integer(self, e):
        if not _INT32[0] <= e <= _INT32[1]:
            # a 0-d int64 tensor: Triton types a bare literal beside an int32 block as int32
            # ("out of range for type int32"), while a captured number arrives as an int64 argument
            return _atom(f"tl.full([], {int(e)}, tl.int64)")
        return _literal(str(int(e)))

    _print_Zero = _print_One = _print_NegativeOne = _print_Integer

    def _print_Rational(self, e):
        return _literal(repr(float(e)))

    _print_Half = _print_Rational

    def _print_Float(self, e):
        return _literal(repr(float(e)))

    def _print_Infinity(self, e):
        return _atom('float("inf")')

    def _print_NegativeInfinity(self, e):
        return _atom('float("-inf")')

    def _print_NaN(self, e):
        return _atom('float("nan")')

    def _print_BooleanTrue(self, e):
        return _atom("True")

    def _print_BooleanFalse(self, e):
        return _atom("False")

    def _print_Exp1(self, e):
        return _literal(repr(float(sympy.E)))

    def _print_Pi(self, e):
        return _literal(repr(float(sympy.pi)))

    # -- arithmetic ---------------------------------------------------------------------------
    def _print_Add(self, e):
        floats = not _integer(e)
        first, *rest = e.args
        text = self._factor(first, floats).operand(_Prec.ADD)
        for a in rest:
            negated, magnitude = self._summand(a, floats)
            text += f" {'-' if negated else '+'} {magnitude.operand(_Prec.ADD + 1)}"
        return _Text(text, _Prec.ADD)

    def _summand(self, a, floats) -> tuple[bool, _Text]:
        """(negated, text) of a term after the first of a sum: a negative number or a product
        with a negative coefficient is subtracted, so that the sum reads `x - 2 * y`."""
        if floats and _position_sum(a) and a.is_Mul:  # -position
            return True, _atom(_FLOAT_POSITIONS[a.args[1]])
        if a.is_Number and a.is_negative:
            return True, self._text(-a)
        if a.is_Mul and a.args[0].is_Number and a.args[0].is_negative:
            quotient = self._division(a.args[1:] if a.args[0] is sympy.S.NegativeOne else (-a.args[0], *a.args[1:]))
            if quotient is not None:
                return True, quotient
            coefficient = [] if a.args[0] is sympy.S.NegativeOne else [self._text(-a.args[0])]
            return True, _join(coefficient + [self._factor(f, floats or not _integer(a)) for f in a.args[1:]], "*",
                               _Prec.MUL)
        return False, self._factor(a, floats)

    def _print_Mul(self, e):
        quotient = self._division(e.args)
        if quotient is not None:
            return quotient
        floats = not _integer(e)
        if e.args[0] is sympy.S.NegativeOne:  # -x * y rather than -1 * x * y
            first, *rest = [self._factor(a, floats) for a in e.args[1:]]
            return _join([_Text(f"-{first.operand(_Prec.UNARY)}", _Prec.UNARY), *rest], "*", _Prec.MUL)
        return _join([self._factor(a, floats) for a in e.args], "*", _Prec.MUL)

    def _division(self, factors) -> _Text | None:
        """The product of `factors` as torch divides (proxy.quotient), each division rounded
        once: of index arithmetic in float32 (tl.math.div_rn: a GPU's float32 `/` is within
        2 ulp); of a captured float element in its dtype (the helper _div); of a score by an
        integer, `/` in the score's dtype; where nothing decides on it (`decides`), a captured
        element's `/` too."""
        found = quotient(factors)
        if found is None:
            return None
        numerator, denominator, scale = found
        both = sympy.Tuple(numerator, denominator)
        if SCORE in dag.free_symbols(both):
            top = _literal("1.0") if numerator == 1 else self._factor(numerator, True)
            value = _join([top, self._factor(denominator, True)], "/", _Prec.MUL)
        elif not dag.atoms(both, LoadFloat):
            value = _atom(f"tl.math.div_rn({self._float(numerator).text}, {self._float(denominator).text})")
        elif self.decides:
            value = self._helper("_div", self._float(numerator).text, self._float(denominator).text)
        else:
            value = _join([self._float(numerator), self._float(denominator)], "/", _Prec.MUL)
        return value if scale == 1 else _join([value, self._text(scale)], "*", _Prec.MUL)

    def _factor(self, a, floats) -> _Text:
        """A term of a sum or a factor of a product: over the float positions where the sum or
        product is a float and `a` a sum of positions, or a polynomial in them."""
        if floats and _position_sum(a):
            return self._float_positions(a)
        if floats and _position_polynomial(a):
            return self._text(a.xreplace(_FLOAT_SYMBOLS))
        return self._text(a)

    def _float_positions(self, e) -> _Text:
        if e.is_Add:
            first, *rest = e.args
            text = self._float_positions(first).text
            for t in rest:
                negated = t.is_Mul or t.is_negative  # -position, or a negative literal
                text += f" {'-' if negated else '+'} {self._float_positions(-t if negated else t).text}"
            return _Text(text, _Prec.ADD)
        if e in _FLOAT_POSITIONS:
            return _atom(_FLOAT_POSITIONS[e])
        if e.is_Integer:
            return _literal(repr(float(e)))
        return _Text(f"-{_FLOAT_POSITIONS[e.args[1]]}", _Prec.UNARY)  # -1 * position

    def _float(self, e) -> _Text:
        """Text of `e` as a float: an integer expression is converted, as torch's float
        functions convert integer tensors."""
        if not _integer(e):
            return self._text(e)
        if e.is_Number:
            return _literal(repr(float(e)))
        if _position_sum(e):
            return self._float_positions(e)
        if _position_polynomial(e):
            return self._text(e.xreplace(_FLOAT_SYMBOLS))
        return _atom(f"{_attribute_of(self._text(e))}.to(tl.float32)")

    def _reciprocal(self, base, text: _Text) -> _Text:
        """1 / text, of `base`: rounded once where it can decide a pair (`_rounds_as_torch`),
        as a GPU's float32 `/` is within 2 ulp; elsewhere `/` in the operand's dtype."""
        if self.decides and _rounds_as_torch(base):
            return self._helper("_div", "1.0", text.text)
        return _Text(f"1.0 / {text.operand(_Prec.MUL + 1)}", _Prec.MUL)

    def _root(self, base) -> _Text:
        """The square root of `base`: correctly rounded where it can decide a pair, as torch's
        (a GPU's float32 tl.sqrt is sqrt.approx: a perfect square's root can come out an ulp off,
        and a comparison with it flip)."""
        text = self._float(base).text
        return self._helper("_sqrt", text) if self.decides and _rounds_as_torch(base) else _atom(f"tl.sqrt({text})")

    def _print_Pow(self, e):
        base, exp = e.args
        # score**2.0 is score * score, as in torch; past 64 factors, the general rule below
        n = multiplied_out(exp)
        if n is not None:
            if n == 0:
                return _atom("1")
            if n < 0 and _integer(base):  # 1 / d of an integer d: torch's true division of integers
                return self._division((e,))
            product = _join([self._text(base)] * abs(n), "*", _Prec.MUL)
            return product if n > 0 else self._reciprocal(base, product)
        if exp.is_Number and float(exp) == 0.5:
            return self._root(base)
        if exp.is_Number and float(exp) == -0.5:
            return self._reciprocal(base, self._root(base))
        if base.is_Number and float(base) == 2.0:
            return _atom(f"tl.math.exp2({self._float(exp).text})")
        if base.is_Number and base > 0:
            return _atom(f"tl.math.exp2({math.log2(base)!r} * {self._float(exp).operand(_Prec.MUL + 1)})")
        return _atom(f"tl.exp({self._float(exp).operand(_Prec.MUL)} * tl.log({self._float(base).text}))")

    def _print_floor(self, e):
        return self._rounding(e, "tl.floor") or self._integer_division("//", "_floordiv", *_quotient(e.args[0]))

    def _print_ceiling(self, e):
        return self._rounding(e, "tl.ceil") or self._integer_division(None, "_ceildiv", *_quotient(e.args[0]))

    def _rounding(self, e, fn: str) -> _Text | None:
        """floor or ceiling `e` as `fn` of a float, or of an integer sympy cannot call one (floor
        of floor(q_idx / p0): p0 may be 0) as that integer; None for a quotient of integers."""
        num, den = _quotient(e.args[0])
        if not _float_rounding(e):
            return self._text(e.args[0]) if den == 1 else None
        argument = self._text(e.args[0]) if den == 1 else self._binary(num, "/", den, _Prec.MUL)
        return _atom(f"{fn}({argument.text})")

    def _integer_division(self, operator: str | None, helper: str, num, den) -> _Text:
        """num / den rounded by `helper` (the template's, with Python's semantics), or by the plain
        `operator` where it agrees: a nonnegative dividend, a positive literal divisor."""
        num_text, den_text = self._integer_text(num), self._integer_text(den)
        if operator and _nonnegative(num) and den.is_Integer and den > 0:
            return _join([num_text, den_text], operator, _Prec.MUL)
        return self._helper(helper, num_text.text, den_text.text)

    def _integer_text(self, e) -> _Text:
        """Text of integer `e` where Triton needs an integer (a pointer offset, `//`, `&`):
        converted to int64 where it is printed over tl.floor or tl.ceil of a float, which Triton
        holds as a float. torch needs `.long()` there, which the trace keeps no node for: it
        converts a value already whole."""
        text = self._text(e)
        if not any(map(_float_rounding, dag.atoms(e, sympy.floor, sympy.ceiling))):
            return text
        return _atom(f"{_attribute_of(text)}.to(tl.int64)")

    def _print_Mod(self, e):
        a, m = e.args
        if not (_integer(a) and _integer(m)):
            if m.is_Rational:  # exact: floor of a rational quotient prints integer division
                floor = self._print_floor(sympy.floor(a / m, evaluate=False))
            else:
                floor = _atom(f"tl.floor({self._binary(a, '/', m, _Prec.MUL).text})")
            return _join([self._text(a), _join([self._text(m), floor], "*", _Prec.MUL)], "-", _Prec.ADD)
        if _nonnegative(a) and m.is_Integer and m > 0:
            return self._binary(a, "%", m, _Prec.MUL)
        return self._helper("_mod", self._print(a), self._print(m))

    def _fold(self, fn, e):
        out = self._print(e.args[0])
        for a in e.args[1:]:
            out = f"{fn}({out}, {self._print(a)})"
        return _atom(out)

    def _print_Min(self, e):
        return self._fold("tl.minimum", e)

    def _print_Max(self, e):
        return self._fold("tl.maximum", e)

    def _print_Abs(self, e):
        return _atom(f"tl.abs({self._print(e.args[0])})")

    def _print_sign(self, e):
        return self._helper("_sign", self._print(e.args[0]))

    def _print_Heaviside(self, e):
        x = self._text(e.args[0]).operand(_Prec.COMPARE + 1)
        at_zero = e.args[1] if len(e.args) > 1 else sympy.Rational(1, 2)
        if at_zero.is_Number and float(at_zero) == 1.0:
            return _atom(f"tl.where({x} >= 0, 1.0, 0.0)")
        if at_zero.is_Number and float(at_zero) == 0.0:
            return _atom(f"tl.where({x} > 0, 1.0, 0.0)")
        return _atom(f"tl.where({x} > 0, 1.0, tl.where({x} == 0, {self._print(at_zero)}, 0.0))")

    def _print_exp(self, e):
        return _atom(f"tl.exp({self._float(e.args[0]).text})")

    def _print_log(self, e):
        return _atom(f"tl.log({self._float(e.args[0]).text})")

    def _print_Float16(self, e):
        return self._helper("_rounded", self._float(e.args[0]).text, "tl.float16")

    def _print_BFloat16(self, e):
        return self._helper("_rounded", self._float(e.args[0]).text, "tl.bfloat16")

    def _print_CustomBackward(self, e):
        return self._text(e.value)  # its gradient is render.score_derivative's

    def _print_tanh(self, e):
        return self._helper("_tanh", self._float(e.args[0]).text)

    def _print_atan(self, e):
        return self._helper("_atan", self._float(e.args[0]).text)

    def _print_sin(self, e):
        return _atom(f"tl.sin({self._float(e.args[0]).text})")

    def _print_cos(self, e):
        return _atom(f"tl.cos({self._float(e.args[0]).text})")

    def _print_erf(self, e):
        return _atom(f"tl.math.erf({self._float(e.args[0]).text})")

    def _print_Piecewise(self, e):
        out = self._print(e.args[-1].expr)
        if e.args[-1].cond is not sympy.true:
            raise ValueError(f"Piecewise {describe(e, 40)} has no default branch; "
                             f"build it with torch.where(cond, a, b)")
        for branch in reversed(e.args[:-1]):
            out = f"tl.where({self._print(branch.cond)}, {self._print(branch.expr)}, {out})"
        return _atom(out)

    def _print_DiracDelta(self, e):
        raise ValueError(f"maskc cannot print DiracDelta ({describe(e, 40)}), the derivative of a step: maskc "
                         f"takes the derivative of sign and Heaviside as 0, as torch does; differentiate with "
                         f"maskc.codegen.render.score_derivative, not sympy.diff")

    def _print_Derivative(self, e):
        raise ValueError(f"maskc cannot print Derivative ({describe(e, 40)}): the expression has no derivative there; "
                         f"differentiate with maskc.codegen.render.score_derivative, which says where")

    # -- integer operations (maskc/trace/symbols.py) ------------------------------------------
    def _print_BitAnd(self, e):
        return _join([self._integer_text(a) for a in e.args], "&", _Prec.AND)

    def _print_BitOr(self, e):
        return _join([self._integer_text(a) for a in e.args], "|", _Prec.OR)

    def _print_BitXor(self, e):
        return _join([self._integer_text(a) for a in e.args], "^", _Prec.XOR)

    def _print_LeftShift(self, e):
        return self._helper("_lshift", self._print(e.args[0]), self._print(e.args[1]))

    def _print_RightShift(self, e):
        return self._helper("_rshift", self._print(e.args[0]), self._print(e.args[1]))

    def _print_Trunc(self, e):
        if e.args[0].is_Number:
            return _literal(str(int(e.args[0])))
        num, den = _quotient(e.args[0])
        if den != 1 and _integer(num) and _integer(den):
            # an integer quotient toward zero, exactly: sympy writes (q - kv) / 3 as q/3 - kv/3,
            # whose float value can round below the integer it equals
            return self._integer_division(None, "_truncdiv", num, den)
        return _atom(f"{_attribute_of(self._text(e.args[0]))}.to(tl.int64)")

    # -- logic --------------------------------------------------------------------------------
    def _relation(self, e, op):
        # both sides bind tighter than a comparison: `(a < b) == c`, never a chain
        lhs, rhs = self._text(e.lhs), self._text(e.rhs)
        return _Text(f"{lhs.operand(_Prec.COMPARE + 1)} {op} {rhs.operand(_Prec.COMPARE + 1)}", _Prec.COMPARE)

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
        return _join([self._condition(a) for a in e.args], "&", _Prec.AND)

    def _print_Or(self, e):
        return _join([self._condition(a) for a in e.args], "|", _Prec.OR)

    def _print_Xor(self, e):
        return _join([self._condition(a) for a in e.args], "^", _Prec.XOR)

    def _condition(self, a) -> _Text:
        """An operand of `&`, `|` or `^`. One free of q_idx and kv_idx may be 0-d (a comparison of
        a captured parameter or element) and is compared with 0: Triton's interpreter broadcasts
        a 0-d comparison of floats as a block of floats, which numpy's bitwise operations refuse
        beside booleans ("ufunc 'bitwise_xor' not supported"), and `!= 0` compares it as an
        integer, which it broadcasts as integers. Compiled Triton takes either."""
        text = self._text(a)
        if self._reads_position(a):
            return text
        return _Text(f"{text.operand(_Prec.COMPARE + 1)} != 0", _Prec.COMPARE)

    def _reads_position(self, e) -> bool:
        """Whether `e` reads q_idx or kv_idx, each node decided once from its arguments': the
        operands of a nest of `&` and `|` share the nest below them, and a walk of each operand
        would make printing the nest quadratic in its depth."""
        memo = self._reads_positions
        stack = [e]
        while stack:
            node = stack[-1]
            if id(node) in memo:
                stack.pop()
                continue
            pending = [a for a in node.args if id(a) not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            memo[id(node)] = (node, node in (Q_IDX, KV_IDX) or any(memo[id(a)][1] for a in node.args))
        return memo[id(e)][1]

    def _print_Not(self, e):
        return _Text(f"~{self._text(e.args[0]).operand(_Prec.UNARY)}", _Prec.UNARY)

    def _print_ITE(self, e):
        return _atom(f"tl.where({self._print(e.args[0])}, {self._print(e.args[1])}, {self._print(e.args[2])})")

    # -- captured tensors ---------------------------------------------------------------------
    def _print_load(self, e):
        slot = int(e.args[0])
        if len(e.args) == 1:
            loaded = self._helper("_widen", f"tl.load(T{slot})")
        else:
            offset, inside = self._element(e, f"T{slot}")
            # `!= 0`: Triton's interpreter gives `scalar_bool & block_bool` a dtype tl.load refuses
            loaded = self._helper("_widen", f"tl.load(T{slot} + {offset}, mask=({inside}) != 0, other=0)")
        return _atom(f"{loaded.text}.to(tl.int64)") if e in self._wide else loaded

    _print_LoadInt = _print_LoadFloat = _print_LoadBool = _print_load

    def _element(self, load, name: str) -> tuple[str, str]:
        """(offset, inside) of captured tensor element `load` in a tensor `name` with strides
        `{name}_stride{d}` and the captured tensor's sizes. An index that can be negative counts
        from the end, as torch's indexing does (t[-1] is the last element; an index that neither
        sympy nor the caller (`negative_indices`) proves nonnegative, like q_idx - kv_idx, pays a
        select for it); one still out of range reads 0."""
        slot = int(load.args[0])
        index = []
        for d, i in enumerate(load.args[1:]):
            text = self._integer_text(i)
            if self.negative_indices and not _nonnegative(i):
                at = text.operand(_Prec.COMPARE + 1)
                text = _atom(f"tl.where({at} < 0, {text.operand(_Prec.ADD)} + T{slot}_size{d}, {text.text})")
            index.append(text)
        offset = " + ".join(f"{i.operand(_Prec.MUL)} * {name}_stride{d}" for d, i in enumerate(index))
        inside = " & ".join(f"({i.operand(_Prec.COMPARE + 1)} >= 0) & ({i.operand(_Prec.COMPARE + 1)} < T{slot}_size{d})"
                            for d, i in enumerate(index))
        return offset, inside

    def address(self, load, name: str) -> tuple[str, str]:
        """(offset, inside) of captured tensor element `load` (`_element`): where a kernel
        accumulates the gradient of that element. Inline text (no statements), for any scope."""
        self._reset(counts=None, uses={}, prefix="", exprs=(load,))
        if len(load.args) == 1:
            return "0", "1"
        return self._element(load, name)


_INT32 = (-(2**31), 2**31 - 1)
# integer operations whose result can leave an operand's type (int32 wraps past 2**31; a remainder cannot)
_ARITHMETIC = (sympy.Add, sympy.Mul, sympy.Pow, sympy.Abs)


def _arithmetic_loads(exprs) -> frozenset:
    """The integer elements of captured tensors that are operands of integer arithmetic in
    `exprs`: read as int64, so that the kernel computes `ids[q_idx] * 100 - ids[kv_idx] * 100`
    exactly, as the block-map analysis and maskc's dense evaluation do, whatever the order the
    canonical form puts the operations in (torch would compute in the table's dtype and wrap).
    Not those of a difference that only meets == 0 or != 0 (the document mask's
    `doc[q_idx] - doc[kv_idx] == 0`): two int32 values differ by less than 2**32, so their
    wrapped difference is 0 exactly when the true one is, and the mask keeps int32 compares."""
    parents: dict = {}  # node -> the nodes it is an operand of
    for expr in exprs:
        for node in dag.postorder(expr):
            parents.setdefault(node, [])
            for a in node.args:
                parents.setdefault(a, []).append(node)

    def wraps_harmlessly(node) -> bool:
        uses = parents[node]
        if not uses:  # an expression's own value (a score's)
            return False
        if node.is_Mul and node.args[0] is sympy.S.NegativeOne:  # -b of a - b
            return all(p.is_Add and wraps_harmlessly(p) for p in uses)
        return (node.is_Add and len(node.args) == 2 and all(_int32_operand(a) for a in node.args)
                and all(isinstance(p, (sympy.Eq, sympy.Ne)) and p.rhs == 0 for p in uses))

    return frozenset(a for node in parents if isinstance(node, _ARITHMETIC) and _integer(node)
                     and not wraps_harmlessly(node) for a in node.args if isinstance(a, LoadInt))


def _int32_operand(e) -> bool:
    """A table element, a position, an int32 literal, or the negation of one."""
    if e.is_Mul and len(e.args) == 2 and e.args[0] is sympy.S.NegativeOne:
        e = e.args[1]
    return isinstance(e, LoadInt) or e in (Q_IDX, KV_IDX, B, H) or (e.is_Integer and _INT32[0] <= e <= _INT32[1])


def _rounds_as_torch(e) -> bool:
    """Whether a reciprocal or root of `e`, in expressions that decide on floats, is printed
    rounded as torch rounds it (the prelude's _div and _sqrt): where `e` reads a position or a
    captured element and no score. A score's value is already a matrix product's rounding away
    from torch's; a runtime scalar's is a Python float in the interpreter (float64 there), which
    the helpers would take as float32."""
    return SCORE not in dag.free_symbols(e) and (bool(dag.atoms(e, LoadFloat, LoadInt, LoadBool)) or any(
        s in _NAMES for s in dag.free_symbols(e)))


def _integer(e) -> bool:
    """Whether `e` is an integer: as sympy knows it, or as the tracer typed it where sympy
    cannot tell (torch's floor(q_idx / p0) is an integer; sympy must allow p0 = 0)."""
    return bool(e.is_integer) or integral(e)


def _nonnegative(e) -> bool:
    """Whether sympy proves `e` nonnegative, where its proof can be trusted (dag.misleads_sympy:
    it calls floor(2/(q_idx + kv_idx + 1) - 1/2) nonnegative, which is -1 from q_idx + kv_idx = 4)."""
    return bool(e.is_nonnegative) and not dag.misleads_sympy(e)


def _float_rounding(e) -> bool:
    """Whether floor or ceiling `e` is printed as tl.floor or tl.ceil of a float, a float to
    Triton though an integer to sympy and the tracer: its argument is no quotient of integers."""
    num, den = _quotient(e.args[0])
    return not (_integer(num) and _integer(den))


def _position_sum(e) -> bool:
    """Whether `e` is ±q_idx, ±kv_idx and integer literals summed, with a position in it."""
    terms = e.args if e.is_Add else (e,)
    return all(_position_term(t) or (t.is_Integer and abs(int(t)) < 2**24) for t in terms) and any(
        _position_term(t) for t in terms)


def _position_polynomial(e) -> bool:
    """Whether `e` is a polynomial in the positions with integer coefficients (sums, products
    and powers of at most 64 of position sums and integer literals), a position in it."""
    def polynomial(x) -> bool:
        if x.is_Integer:
            return abs(int(x)) < 2**24
        if x.is_Pow:
            return x.exp.is_Integer and 1 < int(x.exp) <= 64 and polynomial(x.base)
        if x.is_Add or x.is_Mul:
            return all(polynomial(a) for a in x.args)
        return x in _FLOAT_POSITIONS
    # the walk stops at the first node of another kind; free_symbols walks the whole tree, which
    # for a nest of torch.where is exponential, so it comes last
    return polynomial(e) and bool(e.free_symbols)


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
