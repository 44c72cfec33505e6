"""The Triton kernels, one a module (``quantize_ef``, ``dequantize``, ``reduce_requantize``) with
their shared device functions in ``_tile``. Importing a module here imports Triton; call the
kernels through :mod:`triton_ops.ops` (the functions exported by ``triton_ops``), which checks
first that Triton can run them."""
