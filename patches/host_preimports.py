"""Modules a host imports lazily inside its own setup, for the warm standbys to import ahead.

A standby (``robust_plugins.launcher.standby``) imports the libraries a training script imports
before its rank is known; what a host imports only later, inside its setup, it would otherwise
import after the restart, on the recovery's critical path. Listing those modules names host
internals, so the list lives here. Only imports: nothing is compiled or touches a device.
"""

from __future__ import annotations

#: Host (top-level package) -> modules imported after the host itself. DeepSpeed 0.19's
#: ``deepspeed.initialize`` imports its Muon optimizer module, whose module-level
#: ``torch.compile`` pulls in dynamo and inductor through torch.optim's lazy ``torch._dynamo``.
LAZY: dict[str, tuple[str, ...]] = {
    "deepspeed": ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"),
}
