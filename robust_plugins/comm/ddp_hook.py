"""A PyTorch DDP communication hook running the compressed all-reduce."""

# No `from __future__ import annotations` here: DDP's register_comm_hook compares the hook's
# annotations with the real dist.GradBucket / Future[Tensor] objects and rejects strings.
import torch
import torch.distributed as dist

from robust_plugins._logging import get_logger
from robust_plugins.comm.collectives import compressed_all_reduce
from robust_plugins.comm.state import CompressionState

log = get_logger(__name__)


def ddp_comm_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP gradient bucket with :func:`compressed_all_reduce`.

    Usage: ``ddp.register_comm_hook(CompressionState(codec="int8"), ddp_comm_hook)``. The bucket
    is reduced over ``state.process_group`` under the error-feedback key
    ``("ddp", bucket.index())``; the returned future is already complete. With ``codec="none"``
    the result is bitwise that of DDP's default hook.

    DDP rebuilds its buckets once, after the first iteration, so a bucket index may then name a
    different number of elements; that bucket's residuals (one step's quantization error) are
    dropped, with a log line, instead of raising.
    """
    buf = bucket.buffer()
    key = ("ddp", bucket.index())
    held = state.residual_numel(key)
    if held is not None and held != buf.numel():
        log.info(
            "DDP bucket %d changed from %d to %d elements (bucket rebuild); its error-feedback "
            "residuals restart from zero.",
            bucket.index(),
            held,
            buf.numel(),
        )
        state.forget(key)
    compressed_all_reduce(buf, group=state.process_group, op="avg", state=state, key=key)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut
