"""A DeepSpeed the plugin does not support (its ``__version__`` faked before ``import robust_plugins``,
which reads it when it patches): plain DeepSpeed must train, a config with the block must be
refused with the version, and ``robust prebuild`` must fail naming it. One process, world size 1.

Prints one ``RESULT {json}`` line; the warning goes to stderr. ``--refuse-only`` (the ``robust run``
fault test): build an engine with the block at once, so the refusal ends the rank.
"""

import sys

import deepspeed

deepspeed.__version__ = sys.argv[sys.argv.index("--version") + 1]

import json  # noqa: E402
import os  # noqa: E402

import robust_plugins  # noqa: E402,F401  (after the fake: its hook patches the imported DeepSpeed now)
import torch  # noqa: E402

from robust_plugins.patches import deepspeed as ds_patch  # noqa: E402

# Under robust run a warm standby imported both before this script ran (and patched the real
# version): patch again under the fake, as the hook does at import.
ds_patch.undo()
ds_patch.install()

CFG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0}}


def engine(block: dict | None):
    """A one-rank ZeRO-0 engine of a Linear model, with ``block`` as the config's robust_plugins block."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    cfg = dict(CFG, **({"robust_plugins": block} if block is not None else {}))
    return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)[0]


def main() -> None:
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)  # a launcher's (robust run's) values stay
    if "MASTER_PORT" not in os.environ:
        from robust_plugins.launch import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    deepspeed.init_distributed(dist_backend="gloo")
    if "--refuse-only" in sys.argv:
        engine({"checkpoint": {"memory_every": 1}})
        return
    result = {}
    plain = engine(None)
    losses = []
    for _ in range(3):
        loss = plain(torch.ones(2, 4)).pow(2).sum()
        plain.backward(loss)
        plain.step()
        losses.append(loss.item())
    result["plain_losses"] = losses
    result["plain_has_plugin"] = hasattr(plain, "robust_plugins")
    try:
        engine({"compression": {"codec": "int8"}})
        result["block"] = None
    except robust_plugins.HostVersionError as exc:
        result["block"] = str(exc)
    from robust_plugins.cli.main import main as robust

    result["prebuild_rc"] = robust(["prebuild"])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
