"""Hypothesis profiles for the suite.

`maskc` (the default) keeps the whole suite to a few minutes on a small CPU; pass
`--hypothesis-profile=thorough` for a long fuzzing run. Every failure prints the
`@reproduce_failure` blob that replays it.
"""

from hypothesis import HealthCheck, settings

# Drawing a mask traces it with sympy, which hypothesis's health check can take for a slow strategy.
settings.register_profile("maskc", max_examples=50, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("maskc"), max_examples=2000)
settings.load_profile("maskc")
