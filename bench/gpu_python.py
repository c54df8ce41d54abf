"""The Python peer of `lockstep-bench-dp --device cuda` (scripts/gpu-check):
the same models, batches and optimizer, on PyTorch's own modules:

    .venv/bin/python bench/gpu_python.py [--rounds N] [--seconds S] [--model mlp|cnn]

Contenders: the bare module on cuda:0, torch.nn.DataParallel over every
visible GPU, and torch.nn.parallel.DistributedDataParallel with world size 1
over NCCL. Prints one line per contender, in the C++ benchmark's format.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class ConvNet(nn.Module):  # examples/models.h's ConvNet
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


def make(model):
    if model == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return ConvNet()


def training_step(net, x):
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    y = torch.randint(0, 10, (x.size(0),), device=x.device)

    def step():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()

    return step


def time_steps(step, batch, seconds):
    step()
    torch.cuda.synchronize()
    steps, start = 0, time.perf_counter()
    while True:
        step()
        torch.cuda.synchronize()
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps * batch / elapsed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--model", choices=["mlp", "cnn"])
    args = parser.parse_args()
    assert torch.cuda.is_available(), "gpu_python.py: no CUDA device"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    gpu = torch.device("cuda", 0)
    torch.manual_seed(0)
    for model, batch, shape in (("mlp", 256, (784,)), ("cnn", 128, (1, 28, 28))):
        if args.model and args.model != model:
            continue
        x = torch.randn(batch, *shape, device=gpu)
        contenders = [
            ("py-bare", training_step(make(model).to(gpu), x)),
            ("py-dataparallel", training_step(nn.DataParallel(make(model).to(gpu)), x)),
            ("py-ddp-nccl", training_step(nn.parallel.DistributedDataParallel(make(model).to(gpu), device_ids=[0]), x)),
        ]
        rates = {name: [] for name, _ in contenders}
        for r in range(args.rounds):
            for i in range(len(contenders)):
                name, step = contenders[(i + r) % len(contenders)]
                rates[name].append(time_steps(step, batch, args.seconds))
        base = statistics.median(rates["py-bare"])
        for name, _ in contenders:
            m = statistics.median(rates[name])
            print(f"{model:5s} batch {batch:<4d} {name:14s} {m:10.1f} samples/s   ratio {m / base:.3f}   "
                  f"(rounds: {' '.join(f'{v:.0f}' for v in rates[name])})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
