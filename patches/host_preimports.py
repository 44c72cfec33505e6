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

#: Host (top-level package) -> {name: modules}: when the script's source uses ``name`` (an
#: attribute, a name, or an imported name) and imports the host, the host imports those modules
#: lazily at that call, on a restarted rank's critical path. Measured on the 2-core dev box
#: (torch 2.13, transformers 5.24): ``DistributedDataParallel(...)`` imports ``torch._dynamo``
#: in its constructor (3.8 s of its first call; 0.02 s once imported), FSDP2's ``fully_shard``
#: likewise (7-12 s loaded; 0.14 s); ``from transformers import Trainer`` resolves the lazy
#: ``transformers.trainer`` (14 s loaded, accelerate and dynamo with it).
ON_USE: dict[str, dict[str, tuple[str, ...]]] = {
    "torch": {
        "DistributedDataParallel": ("torch._dynamo",),
        # FSDP2 state dicts (the Snapshotter's, DCP's) go through state_dict's helpers (0.5 s).
        "fully_shard": ("torch._dynamo", "torch.distributed.checkpoint.state_dict"),
        "FullyShardedDataParallel": ("torch._dynamo",),
    },
    "transformers": {
        "Trainer": ("transformers.trainer",),
        "Seq2SeqTrainer": ("transformers.trainer_seq2seq",),
        "TrainingArguments": ("transformers.training_args",),
        "AutoModelForCausalLM": ("transformers.models.auto.modeling_auto",),
        "AutoTokenizer": ("transformers.models.auto.tokenization_auto",),
        "AutoConfig": ("transformers.models.auto.configuration_auto",),
    },
}
