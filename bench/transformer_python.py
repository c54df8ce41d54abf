"""The Python twins of lockstep-bench-transformer (scripts/gpu_bench.sh): the same models, shapes, batches,
bf16 autocast and AdamW, under PyTorch's own DistributedDataParallel and FSDP2 (fully_shard, each block a unit)
at world size 1, from the configuration's PyTorch.

    python3 bench/transformer_python.py CONTENDER MODEL [--device cuda|cpu] [--size full|tiny] [--steps N]

CONTENDER: python-ddp | python-fsdp2 | python-fsdp2-checkpointed (each block under torch.utils.checkpoint).
Prints one line in lockstep-bench-transformer's format:
    CONTENDER MODEL items_per_s=X unit=tokens|samples peak_mem_mb=M flops_per_s=F params=P
"""
import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_python import Gpt, VisionTransformer  # noqa: E402


def shape_of(model, size, batch):
    """bench_transformer.cpp's shape_of: (vocab, context, dim, depth, heads, batch)."""
    s = (50304, 512, 768, 12, 12, 16) if model == "gpt" else (10, 50, 384, 12, 6, 256)
    if size == "tiny":
        s = (256, 32, 32, 2, 2, 4) if model == "gpt" else (10, 50, 32, 2, 2, 8)
    return s[:5] + (batch or s[5],)


class Checkpointed(nn.Module):
    """A block whose activations backward makes again, as lockstep::checkpoint."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("contender", choices=["python-ddp", "python-fsdp2", "python-fsdp2-checkpointed"])
    parser.add_argument("model", choices=["gpt", "vit"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=0)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 10000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    vocab, context, dim, depth, heads, batch = shape_of(args.model, args.size, args.batch)
    net = Gpt(vocab, context, dim, depth, heads, 0.0) if args.model == "gpt" else VisionTransformer(dim, depth, heads, 0.0)
    params = sum(p.numel() for name, p in net.named_parameters() if name not in ("wpe", "pos_embed"))
    if args.contender == "python-fsdp2-checkpointed":
        net.blocks = nn.ModuleList([Checkpointed(b) for b in net.blocks])
    net.to(device)
    if args.contender == "python-ddp":
        net = nn.parallel.DistributedDataParallel(net, device_ids=[0] if device.type == "cuda" else None)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    text = args.model == "gpt"
    x = torch.randint(0, vocab, (batch, context), device=device) if text else torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, vocab, (batch, context), device=device) if text else torch.randint(0, 10, (batch,), device=device)

    def step():
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = net(x)
        nn.functional.cross_entropy(logits.flatten(0, -2).float(), y.flatten()).backward()
        opt.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    samples_per_s = args.steps * batch / seconds
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20
    flops = 6.0 * params * context + 12.0 * depth * dim * context * context  # bench_transformer.cpp's flops_per_sample
    print(f"{args.contender} {args.model} items_per_s={samples_per_s * (context if text else 1):.1f} "
          f"unit={'tokens' if text else 'samples'} peak_mem_mb={peak:.1f} flops_per_s={samples_per_s * flops:.4g} "
          f"params={params}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
