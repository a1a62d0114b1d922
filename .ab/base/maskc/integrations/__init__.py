"""Integrations: maskc behind other libraries' interfaces (FlexAttention's API, Hugging Face
transformers), built on maskc's public API only (the core never imports them). Each submodule is
imported by name, e.g. maskc.integrations.flex or maskc.integrations.transformers.
"""
