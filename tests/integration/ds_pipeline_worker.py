"""Every pipeline-engine checkpoint scenario of ``test_deepspeed_pipeline.py`` in one set of 4 ranks.

``scenarios(rank, world, out)`` runs under ``tests/_dist.run_ranks(..., init=False)``: a 4-layer
byte model as a ``PipelineModule`` of 2 stages x 2 data-parallel replicas, ZeRO-1, fp32, a client
``torch.optim.AdamW``, 2 micro-batches a step. A "restart" is a fresh engine of a differently
seeded model in the same processes: it sees only what the previous engines left in ``/dev/shm``
and on disk.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid

import robust_plugins  # noqa: F401  (installs the DeepSpeed patch)

import torch
import torch.nn.functional as F
from torch import nn

from robust_plugins.checkpoint import memory
from robust_plugins.workloads.text import get_batch, load_corpus

SEED = 1234
MICRO_BATCH = 4
SEQ_LEN = 32
WIDTH = 64
STEPS = 6


class Embed(nn.Module):
    """Token and position embeddings (stage 0's first layer)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(256, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ_LEN, WIDTH) * 0.02)

    def forward(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    """A pre-norm MLP block."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, 256)

    def forward(self, x):
        return self.out(self.ln(x))


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")

    def take(self) -> list[str]:
        out, self.lines = self.lines, []
        return out


def make_engine(block, seed=SEED, sgd=False):
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(Embed), LayerSpec(Block), LayerSpec(Block), LayerSpec(Head)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform",
                           seed_layers=True, base_seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    # SGD(lr=1): one step's update is the reduced gradient itself (the hierarchy scenarios' oracle).
    opt = torch.optim.SGD(params, lr=1.0) if sgd else torch.optim.AdamW(params, lr=3e-3)
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2,
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e6}}
    if block is not None:
        cfg["robust_plugins"] = block
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train(engine, until, corpus) -> list[float]:
    losses = []
    dp, dp_world = engine.grid.data_parallel_id, engine.grid.data_parallel_size
    while engine.global_steps < until:
        micro = [get_batch(corpus, "train", seed=SEED, step=2 * engine.global_steps + m, rank=dp,
                           world_size=dp_world, micro_batch=MICRO_BATCH, seq_len=SEQ_LEN) for m in range(2)]
        losses.append(float(engine.train_batch(iter(micro))))
    return losses


def state_digest(engine) -> str:
    """sha256 of this rank's stage parameters and its ZeRO-1 fp32 partition and Adam state."""
    h = hashlib.sha256()
    for _, p in sorted(engine.module.named_parameters()):
        h.update(p.detach().contiguous().numpy().tobytes())
    for t in engine.optimizer.single_partition_of_fp32_groups:
        h.update(t.detach().contiguous().numpy().tobytes())
    for st in engine.optimizer.optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                h.update(v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def scenarios(rank: int, world: int, out: str) -> dict:
    """Every scenario on this rank (module docstring); returns this rank's results."""
    import deepspeed
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    records = Records()
    logging.getLogger("robust_plugins").addHandler(records)
    logging.getLogger("robust_plugins").setLevel(logging.INFO)
    corpus = load_corpus(max_bytes=200_000)
    ids = [None] * world
    dist.all_gather_object(ids, uuid.uuid4().hex)
    os.environ[memory.ENV_JOB] = ids[0]
    key = memory.job_key()
    root = os.path.join(out, "ckpt")
    block = {"checkpoint": {"dir": root, "memory_every": 1, "peer_backup": True}}
    res: dict = {}
    ref = make_engine(None)
    res["reference"] = {"losses": train(ref, STEPS, corpus), "digest": state_digest(ref),
                        "stage": ref.stage_id, "dp": ref.grid.data_parallel_id}
    # Snapshots every step, a verified save at step 2, stop at 3 (the "crash").
    main = make_engine(block)
    losses = train(main, 2, corpus)
    main.save_checkpoint(root)
    losses += train(main, 3, corpus)
    main.robust_plugins.memory.store.flush()
    res["main"] = {"losses": losses, "ckpt_files": sorted(os.listdir(os.path.join(root, "global_step2"))),
                   "holders": main.robust_plugins.memory.peers.holders, "log": records.take()}
    engines = [main]

    def restart(seed, until):
        e = make_engine(block, seed=seed)
        engines.append(e)
        path, _ = e.load_checkpoint(root)
        info = {"load_path": path, "resumed_at": e.global_steps, "restored": e.robust_plugins.memory.restored,
                "log": records.take(), "losses": train(e, until, corpus)}
        info["digest"] = state_digest(e)
        e.robust_plugins.memory.store.flush()
        return info

    res["own"] = restart(5, STEPS)  # each stage's own snapshot of step 3
    dist.barrier()
    if rank == 0:
        memory.remove_job(key)
    dist.barrier()
    res["disk"] = restart(7, STEPS)  # no snapshot: the verified pipeline checkpoint of step 2
    # Compression of each stage's data-parallel reduction: codec none against the vanilla
    # reference, int8 with the bytes of one step's reduction counted on the stage's DP group.
    from robust_plugins.comm import WireCounter

    for name, comp in (("none", {"codec": "none"}), ("int8", {"codec": "int8", "block_size": 256,
                                                               "min_numel": 0, "warmup_steps": 0})):
        block = {"compression": comp}
        if name == "int8":  # and telemetry: the loss from the last stage, each stage's DP bytes
            block["telemetry"] = {"dir": os.path.join(out, "telemetry"), "log_every": 1}
        e = make_engine(block)
        losses = train(e, STEPS - 1, corpus)
        with WireCounter(filter_group=e.grid.get_data_parallel_group()) as wire:
            losses += train(e, STEPS, corpus)
        stats = e.robust_plugins.sync.stats
        res[f"codec_{name}"] = {"losses": losses, "digest": state_digest(e), "by_op": dict(wire.by_op),
                                "compressed_elements": stats.compressed_elements,
                                "grad_numel": sum(p.numel() for p in e.module.parameters())}
        if name == "int8":
            e.robust_plugins.telemetry.close()
            dist.barrier()
            path = os.path.join(out, "telemetry", "metrics.jsonl")
            import json

            res["telemetry"] = [json.loads(x) for x in open(path)] if rank == 0 else []
    res["hier"] = hierarchy_scenarios(corpus)
    for e in engines:
        e.robust_plugins.memory.close(remove=True)
    dist.barrier()
    if rank == 0:
        memory.remove_job(key)
    res["shm_left"] = memory.job_files(key)
    return res


_INT8 = {"codec": "int8", "block_size": 256, "min_numel": 0, "warmup_steps": 0}
_HIER = {"hierarchical": True}
#: (name, simulated layout, block). DeepSpeed's pipeline grid is stage-major: stage 0 is ranks
#: {0,1}, stage 1 is {2,3}, and those pairs are the DP groups. "2x2" puts each stage on one node
#: (its DP pair never crosses a node); "4x1" puts every rank on a node of its own (each DP pair
#: spans two nodes: its node group is the rank itself, its rail the pair).
HIERARCHY = (
    ("vanilla", None, None),
    ("hier_none_4x1", "4x1", {"compression": {"codec": "none"}, "topology": _HIER}),
    ("hier_none_2x2", "2x2", {"compression": {"codec": "none"}, "topology": _HIER}),
    ("hier_int8_4x1", "4x1", {"compression": _INT8, "topology": _HIER}),
    ("hier_int8_2x2", "2x2", {"compression": _INT8, "topology": _HIER}),
    # Told a 10 Mbit/s link between nodes: the cost model alone decides, between none and int8
    # (with bf16_allreduce among the candidates, the measured latency and codec cost on loaded
    # cores decide between it and int8 on a pair of ranks).
    ("auto_4x1", "4x1", {"compression": {"codec": "auto", "auto_link_gbit": 0.01, "auto_candidates": ["int8"],
                                         "min_numel": 0, "warmup_steps": 0},
                         "topology": _HIER}),
)


def hierarchy_scenarios(corpus) -> dict:
    """One SGD(lr=1) step per :data:`HIERARCHY` entry: this rank's update (its stage's reduced
    gradient), the largest local gradient before the reduction, the sync's statistics and groups
    and, for ``hier_int8_*``, the bytes on the node and rail groups of the stage's DP group."""
    from robust_plugins.comm import WireCounter
    from robust_plugins.topology.discover import SIM_ENV

    out = {}
    for name, layout, block in HIERARCHY:
        os.environ.pop(SIM_ENV, None)
        if layout is not None:
            os.environ[SIM_ENV] = layout
        e = make_engine(block, sgd=True)
        params = [p for p in e.module.parameters()]
        before = torch.cat([p.detach().flatten().clone() for p in params])
        absmax = []
        reduce = e.allreduce_gradients

        def allreduce_gradients(*args, _reduce=reduce, **kwargs):
            absmax.append(max(float(p.grad.abs().max()) for p in params if p.grad is not None))
            return _reduce(*args, **kwargs)

        e.allreduce_gradients = allreduce_gradients
        counters = {}
        plugin = getattr(e, "robust_plugins", None)
        if name.startswith("hier_int8"):
            # Built now, so the counters can filter on them; the other scenarios build them where
            # a user's job does, at the first bucket of the schedule's ReduceGrads (a collective
            # over the job there).
            groups = plugin.sync._hierarchy(e.grid.get_data_parallel_group())
            counters = {"rail": WireCounter(groups.rail), "intra": WireCounter(groups.intra)}
        for c in counters.values():
            c.__enter__()
        try:
            train(e, 1, corpus)
        finally:
            for c in counters.values():
                c.__exit__(None, None, None)
        r = {"update": before - torch.cat([p.detach().flatten() for p in params]), "absmax": absmax[0],
             "bytes": {k: c.bytes_sent for k, c in counters.items()}, "numel": before.numel()}
        if block is not None:
            g, st = plugin.sync._hierarchy(e.grid.get_data_parallel_group()), plugin.sync.stats
            r.update(intra=list(g.intra_ranks), rail=list(g.rail_ranks), planned=g.plan is not None,
                     by_codec=dict(st.by_codec), by_route=dict(st.by_route), hier=st.hierarchical_elements,
                     decisions=[(d["route"], d["codec"]) for d in st.auto_decisions])
        out[name] = r
    os.environ.pop(SIM_ENV, None)
    return out
