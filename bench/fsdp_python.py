"""One contender of bench/run_ddp_bench.sh: PyTorch's own FSDP2 (fully_shard, FullShard with
reshard_after_forward) from the configuration's PyTorch, on the CPU over gloo, 2 processes of one
thread each, with the model, batch, optimizer and units of bench/bench_ddp.cpp's "fullshard" (each
Linear of the Sequential one unit, the root the rest).

    python3 bench/fsdp_python.py MODEL STEPS PORT OPTIMIZER

Rank 0 prints: python-fsdp MODEL steps_per_s=X rss_mb=R0,R1
"""
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from ddp_python import make_model


def run(rank, world, model_name, steps, port, optimizer):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    net = make_model(model_name)
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    batch = 256 // world
    x = torch.randn(batch, 784 if model_name == "mlp" else 256)
    y = torch.randint(0, 10, (batch,))
    if optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(5):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - start
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
    gathered = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(gathered, rss)
    if rank == 0:
        print(f"python-fsdp {model_name} steps_per_s={steps / seconds:.2f} rss_mb=" +
              ",".join(f"{t.item():.1f}" for t in gathered), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    model_name, steps, port, optimizer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mp.spawn(run, args=(2, model_name, steps, port, optimizer), nprocs=2)
