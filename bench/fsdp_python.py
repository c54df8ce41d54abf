"""One contender of bench/run_ddp_bench.sh: PyTorch's own FSDP2 (fully_shard, FullShard with
reshard_after_forward) from the configuration's PyTorch, on the CPU over gloo, 2 processes of one
thread each, with the model, batch, optimizer and units of bench/bench_ddp.cpp's "fullshard" (each
Linear of the Sequential one unit, the root the rest).

    python3 bench/fsdp_python.py MODEL STEPS PORT OPTIMIZER

Rank 0 prints: python-fsdp MODEL steps_per_s=X rss_mb=R0,R1
"""
import sys

import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from ddp_python import join_group, make_model, time_training


def run(rank, world, model_name, steps, port, optimizer):
    join_group(rank, world, port)
    net = make_model(model_name)
    # The transformers' blocks, else each Linear layer: units as lockstep's benchmark shards them.
    units = net.blocks if hasattr(net, "blocks") else [m for m in net.children() if isinstance(m, nn.Linear)]
    for unit in units:
        fully_shard(unit)
    fully_shard(net)
    time_training("python-fsdp", net, model_name, steps, rank, world, optimizer)
    dist.destroy_process_group()


if __name__ == "__main__":
    model_name, steps, port, optimizer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mp.spawn(run, args=(2, model_name, steps, port, optimizer), nprocs=2)
