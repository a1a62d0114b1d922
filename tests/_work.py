"""Work counted in Python function calls: what the tests that guard against blow-ups compare,
where seconds would depend on the machine and its load.

A count depends on the code run and on what earlier tests left in caches (sympy's, maskc's),
so a test compares counts it takes itself (one step at two sizes, or a first call with a
second) rather than fixed numbers. A blow-up that never ends is left to the test's
`@pytest.mark.timeout`.

>>> small = python_calls(canonicalize, nest(10))
>>> assert python_calls(canonicalize, nest(20)) < 16 * small
"""
import cProfile


def python_calls(fn, *args, **kwargs) -> int:
    """The Python function calls that fn(*args, **kwargs) makes, fn's own included; calls of
    C functions are not counted."""
    profile = cProfile.Profile(builtins=False)
    profile.enable()
    try:
        fn(*args, **kwargs)
    finally:
        profile.disable()
    return sum(entry.callcount for entry in profile.getstats())
