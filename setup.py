"""Packaging's one dynamic part: the top-level ``patches/`` and ``recipes/`` folders (the design
card's layout) install as ``robust_plugins.patches`` / ``robust_plugins.recipes``, so the wheel
never puts generic top-level names such as ``patches`` into site-packages. Everything else is in
pyproject.toml."""

from setuptools import find_packages, setup

#: Subpackage of robust_plugins -> the repository folder it is built from.
MAPPED = {"robust_plugins.patches": "patches", "robust_plugins.recipes": "recipes"}

packages = find_packages(include=["robust_plugins", "robust_plugins.*", "triton_ops", "triton_ops.*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=dict(MAPPED))
