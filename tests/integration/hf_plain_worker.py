"""A plain DeepSpeed script (no Trainer, no logging set up): one engine with the block, one step.

Rank 0 writes ``<out>`` with the handlers of the root and ``robust_plugins`` loggers after the
engine was built (the library must have added none)."""

import robust_plugins  # noqa: F401,I001

import json
import logging
import sys

import deepspeed
import torch
import torch.distributed as dist
from _exit import leave_without_teardown

cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
       "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
       "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6},
       "robust_plugins": {"compression": {"codec": "int8", "min_numel": 0}}}
model = torch.nn.Linear(8, 8)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
loss = engine(torch.randn(2, 8)).square().mean()
engine.backward(loss)
engine.step()
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"root_handlers": len(logging.getLogger().handlers),
                   "robust_handlers": len(logging.getLogger("robust_plugins").handlers)}, f)
leave_without_teardown()  # the result is written; see _exit.py
