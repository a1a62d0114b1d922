"""The exceptions maskc raises for user mistakes.

Every message states the rule, what was got, and the fix, in one lowercase sentence.
"""


class MaskcError(Exception):
    """Base class of every error maskc raises about its input."""


class MaskTraceError(MaskcError, TypeError):
    """A mask_mod or score_mod cannot be traced into an expression.

    Example message: ``mask_mod 'sliding' uses Python control flow on a traced value at
    masks.py:12; use torch.where(cond, a, b) or & | ~ instead``.
    """
