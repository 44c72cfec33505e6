"""The ``robust_plugins`` block schema as pydantic v2 models; import it from ``robust_plugins.config``.

This package imports nothing on its own: ``common`` (constants, ``load_json``) is pydantic-free, and
the models (``plugin`` and the section modules) import pydantic, which ``robust_plugins.config``
loads only when a model is first used, so ``import robust_plugins`` stays cheap.
"""
