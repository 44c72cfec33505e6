"""torch.distributed's default store, which torch keeps privately.

:func:`robust_plugins.megatron.apply_rank_order` re-creates the default process group with each
process at its new rank and needs the old group's store for it (same store, a fresh key prefix).
"""

from __future__ import annotations

from typing import Any


def default_store() -> Any:
    """The default process group's store, or None when this torch has no
    ``distributed_c10d._get_default_store`` (the caller says what to do instead).

    Holding the returned reference keeps a store hosted by this process (rank 0 without
    torchrun's agent store) alive across ``destroy_process_group``."""
    import torch.distributed as dist

    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    return None if get_store is None else get_store()
