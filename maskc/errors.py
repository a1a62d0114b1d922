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


class SettingError(MaskcError, ValueError):
    """An environment setting (maskc/settings.py) holds a value it does not accept.

    Example message: ``MASKC_CACHE_MAX_SIZE must be a size like 500M or 2G (K, M, G, T: powers of
    1024) or none, got '1e3'; fix or unset it``.
    """
