"""Integrations: maskc behind other libraries' interfaces, built on maskc's public API only
(the core never imports them). Each submodule is imported by name, e.g. maskc.integrations.flex.
"""
