"""``robust bench <name>``: benchmarks whose numbers go into BENCHMARKS.md.

``command`` is ``robust bench``; one module a benchmark (``compression``, ``kernels``, ``comm``,
``checkpoint``), each with an ``add_parser``; the ``*_worker`` modules run inside the ranks a
benchmark launches (``python -m``) and import none of the others; every benchmark writes its
section through :func:`~robust_plugins.cli.bench.writer.write_section`. This package imports
nothing, so a worker rank loads only its own module.
"""
