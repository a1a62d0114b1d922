"""The sympy vocabulary of traced expressions: index symbols, parameters and tensor loads."""
import operator

import sympy

# Index arguments are nonnegative integers; declaring it lets sympy fold `q_idx >= 0` to True.
B = sympy.Symbol("b", integer=True, nonnegative=True)
H = sympy.Symbol("h", integer=True, nonnegative=True)
Q_IDX = sympy.Symbol("q_idx", integer=True, nonnegative=True)
KV_IDX = sympy.Symbol("kv_idx", integer=True, nonnegative=True)
SCORE = sympy.Symbol("score", real=True)
INDEX_SYMBOLS = (B, H, Q_IDX, KV_IDX)


def param_symbol(position: int, is_int: bool) -> sympy.Symbol:
    """The symbol of the runtime scalar parameter at `position` (p0, p1, ...)."""
    if is_int:
        return sympy.Symbol(f"p{position}", integer=True)
    return sympy.Symbol(f"p{position}", real=True)


def is_param(sym) -> bool:
    return isinstance(sym, sympy.Symbol) and sym.name[:1] == "p" and sym.name[1:].isdigit()


class _Load(sympy.Function):
    # A load of a constant index (a 0-d captured tensor is LoadFloat(0)) has no free symbols,
    # which sympy takes for a number it can evaluate and compare: Max(score, LoadFloat(0))
    # would ask for its value. Its value is known only when the kernel runs.
    is_number = False


class LoadInt(_Load):
    """`LoadInt(t, i0, i1, ...)`: element (i0, i1, ...) of captured integer tensor number t."""

    def _eval_is_integer(self):
        return True

    def _eval_is_real(self):
        return True


class LoadFloat(_Load):
    """`LoadFloat(t, i0, ...)`: element of captured floating-point tensor number t."""

    def _eval_is_real(self):
        return True


class LoadBool(_Load):
    """`LoadBool(t, i0, ...)`: element of captured boolean tensor number t, read as 0 or 1."""

    def _eval_is_integer(self):
        return True

    def _eval_is_nonnegative(self):
        return True


LOADS = (LoadInt, LoadFloat, LoadBool)


def is_load(expr) -> bool:
    return isinstance(expr, LOADS)


# -- integer operations sympy has no node for ------------------------------------------------
# The tracer builds them, the printer prints them, and the interval and dense evaluators give
# them ranges and values; each is an integer of its integer arguments, with torch's semantics.
class _IntegerOp(sympy.Function):
    @classmethod
    def eval(cls, *args):
        # Of numbers, the number: a torch.where's branch put in for its argument
        # (canonical._split) must leave something sympy's Min and Max can compare, not an
        # unevaluated Trunc(3/2) that they refuse.
        if all(isinstance(a, sympy.Integer) for a in args):
            value = cls._of_integers(*map(int, args))
            if value is not None and -2**63 <= value < 2**63:
                return sympy.Integer(value)
        return None

    def _eval_is_integer(self):
        return True

    def _eval_is_real(self):
        return True


class BitAnd(_IntegerOp):
    """`a & b` of integers (torch.bitwise_and)."""

    nargs = 2
    _of_integers = staticmethod(operator.and_)


class BitOr(_IntegerOp):
    """`a | b` of integers (torch.bitwise_or)."""

    nargs = 2
    _of_integers = staticmethod(operator.or_)


class BitXor(_IntegerOp):
    """`a ^ b` of integers (torch.bitwise_xor)."""

    nargs = 2
    _of_integers = staticmethod(operator.xor)


class LeftShift(_IntegerOp):
    """`a << b` of integers, b >= 0 (a literal shift is traced as a * 2**b instead)."""

    nargs = 2

    @staticmethod
    def _of_integers(a, b):
        return a << b if 0 <= b < 64 else None  # torch gives 0 from 64 on


class RightShift(_IntegerOp):
    """`a >> b` of integers: floor(a / 2**b), b >= 0 (a literal shift is traced as floor instead)."""

    nargs = 2

    @staticmethod
    def _of_integers(a, b):
        return a >> b if b >= 0 else None


class Trunc(_IntegerOp):
    """A float converted to an integer dtype (`.long()`, `.to(torch.int32)`): rounds toward zero."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if x.is_Number and x.is_finite:
            return sympy.Integer(int(x))  # int() rounds toward zero, as proxy.trunc does
        return None


INTEGER_OPS = (BitAnd, BitOr, BitXor, LeftShift, RightShift, Trunc)


# -- float roundings sympy has no node for ------------------------------------------------------
class _Rounded(sympy.Function):
    """A float rounded to a narrower float dtype and read back: `x.to(torch.bfloat16)` in a mod,
    where it meets float32 again. Nondecreasing; its derivative is 1, as torch's autograd passes
    a cast's gradient through."""

    nargs = 1
    is_number = False  # of a constant too: sympy cannot evaluate it (Max would ask)

    def _eval_is_real(self):
        return self.args[0].is_real

    def fdiff(self, argindex=1):
        return sympy.Integer(1)


class Float16(_Rounded):
    """`x.half()`, `x.to(torch.float16)`: rounded to float16 (nearest, ties to even)."""


class BFloat16(_Rounded):
    """`x.bfloat16()`, `x.to(torch.bfloat16)`: rounded to bfloat16 (nearest, ties to even)."""


ROUNDED = (Float16, BFloat16)


# -- a torch.autograd.Function's value, with the gradient its own backward gives ----------------
class CustomBackward(sympy.Function):
    """`CustomBackward(value, x1, s1, x2, s2, ...)`: what a torch.autograd.Function's forward
    computed (`value`) from its inputs x1, x2, ..., whose gradient is the one the Function's
    backward gives, d/dx_i = s_i (backward(ctx, grad) returned grad * s_i), whatever the
    derivative of `value` is: torch runs the backward it is given (a straight-through estimator
    is not its forward's derivative). It evaluates, prints and ranges as `value`; only
    differentiation reads the pairs. They are arguments, so that they are in the signature: the
    same forward with another backward is another kernel."""

    @property
    def value(self):
        return self.args[0]

    @property
    def pairs(self) -> tuple:
        """(x_i, s_i) for each input that receives a gradient."""
        return tuple(zip(self.args[1::2], self.args[2::2]))

    def _eval_is_real(self):
        return self.args[0].is_real

    def fdiff(self, argindex=1):
        # the chain rule sums fdiff(i) * d(argument i): through each x_i its slope s_i, which is
        # the argument after it; nothing through the value or the slopes
        return self.args[argindex] if argindex % 2 == 0 else sympy.Integer(0)
