"""Integrations of kernforge with model libraries.

Each lives in its own submodule and needs its library, installed with an extra (for example
``pip install 'kernforge[transformers]'`` for :mod:`kernforge.integrations.transformers`); importing
``kernforge`` imports none of them.
"""
