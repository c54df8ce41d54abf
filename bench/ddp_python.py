"""One contender of bench/run_ddp_bench.sh: PyTorch's own DistributedDataParallel
(the configuration's PyTorch: .venv/'s or Debian's python3-torch), gloo, 2 processes of one thread each, with the same
model, batch, optimizer and thread count as bench/bench_ddp.cpp.

    python3 bench/ddp_python.py MODEL STEPS PORT [OPTIMIZER]

Rank 0 prints: python MODEL steps_per_s=X rss_mb=R0,R1

With RANK and WORLD_SIZE set (torchrun's variables, as lockstep-run sets
them), this process is that one rank, at MASTER_ADDR:MASTER_PORT, instead of
spawning two: how bench/netlab_bench.sh runs it across the lab's hosts.
BENCH_HOOK=powersgd registers PyTorch's powerSGD_hook (rank
BENCH_POWERSGD_RANK, default 4, from the third step); BENCH_BUCKET_CAP_MB
sets bucket_cap_mb; BENCH_PRECISION=bf16 runs forward under CPU autocast to
bfloat16, as lockstep-bench-ddp --precision bf16; BENCH_BATCH=N sets the global batch, as --batch N.
"""
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


class ConvNet(nn.Module):
    """examples/models.h's ConvNet."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 16, 5, padding=2), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 5, padding=2), nn.BatchNorm2d(32)
        self.fc1, self.fc2 = nn.Linear(32 * 7 * 7, 128), nn.Linear(128, 10)

    def forward(self, x):
        h = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        h = torch.max_pool2d(torch.relu(self.bn2(self.conv2(h))), 2)
        return self.fc2(torch.relu(self.fc1(h.flatten(1))))


class TransformerBlock(nn.Module):
    """examples/models.h's TransformerBlock: pre-norm attention (one qkv projection, causal or not) and a 4x MLP."""

    def __init__(self, dim, heads, dropout, causal=False):
        super().__init__()
        self.dim, self.heads, self.p, self.causal = dim, heads, dropout, causal
        self.norm1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        batch, length, head_dim = x.size(0), x.size(1), self.dim // self.heads
        parts = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
        scores = parts[0].matmul(parts[1].transpose(-2, -1)) / head_dim ** 0.5
        if self.causal:
            later = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(later, float("-inf"))
        drop = lambda t: torch.dropout(t, self.p, self.training)
        attended = drop(torch.softmax(scores, -1)).matmul(parts[2])
        h = x + drop(self.proj(attended.transpose(1, 2).reshape(batch, length, self.dim)))
        return h + drop(self.fc2(drop(torch.nn.functional.gelu(self.fc1(self.norm2(h))))))


class VisionTransformer(nn.Module):
    """examples/models.h's VisionTransformer: 4x4 patches, a class token, 4 blocks of width 64."""

    def __init__(self, dim=64, depth=4, heads=4, dropout=0.1):
        super().__init__()
        self.dim, self.p = dim, dropout
        self.patch = nn.Conv2d(1, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 50, dim) * 0.02)
        self.blocks = nn.ModuleList([TransformerBlock(dim, heads, dropout) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(x.size(0), 1, self.dim), tokens], 1) + self.pos_embed
        tokens = torch.dropout(tokens, self.p, self.training)
        for block in self.blocks:
            tokens = block(tokens)
        return self.head(self.norm(tokens[:, 0]))


class Gpt(nn.Module):
    """examples/models.h's Gpt: byte tokens, learned positions, causal blocks, logits from the tied embedding."""

    def __init__(self, vocab=256, context=128, dim=128, depth=4, heads=4, dropout=0.1):
        super().__init__()
        self.p = dropout
        self.wte = nn.Embedding(vocab, dim)
        nn.init.normal_(self.wte.weight, 0, 0.02)
        self.wpe = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList([TransformerBlock(dim, heads, dropout, causal=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens):
        h = torch.dropout(self.wte(tokens) + self.wpe[: tokens.size(1)], self.p, self.training)
        for block in self.blocks:
            h = block(h)
        return torch.nn.functional.linear(self.norm(h), self.wte.weight)


GPT_BATCH, GPT_CONTEXT = 16, 128  # bench/bench_ddp.cpp's kGptBatch and kGptContext


def make_model(name):
    if name == "cnn":
        return ConvNet()
    if name == "vit":
        return VisionTransformer()
    if name == "gpt":
        return Gpt()
    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if name == "wide":
        return nn.Sequential(*[m for i in range(8) for m in (nn.Linear(256 if i == 0 else 2048, 2048), nn.ReLU())])
    layers = []
    for _ in range(48):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers)


def join_group(rank, world, port):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)


def time_training(label, net, model_name, steps, rank, world, optimizer):
    """Times `steps` steps of `net` after 5 untimed ones; rank 0 prints LABEL MODEL steps_per_s=X rss_mb=R0,R1."""
    images = model_name in ("cnn", "vit")
    given = int(os.environ.get("BENCH_BATCH", "0"))
    if model_name == "gpt":
        x = torch.randint(0, 256, ((given or GPT_BATCH) // world, GPT_CONTEXT))
        y = torch.randint(0, 256, ((given or GPT_BATCH) // world, GPT_CONTEXT))
    else:
        batch = (given or (64 if images else 256)) // world
        x = torch.randn(batch, 1, 28, 28) if images else torch.randn(batch, 784 if model_name == "mlp" else 256)
        y = torch.randint(0, 10, (batch,))
    bf16 = os.environ.get("BENCH_PRECISION", "fp32") == "bf16"
    if optimizer == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = net(x).float()
        loss_fn(logits.flatten(0, -2), y.flatten()).backward()
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
        print(f"{label} {model_name} steps_per_s={steps / seconds:.2f} rss_mb=" + ",".join(f"{t.item():.1f}" for t in gathered),
              flush=True)


def run(rank, world, model_name, steps, port, optimizer):
    join_group(rank, world, port)
    net = nn.parallel.DistributedDataParallel(make_model(model_name),
                                              bucket_cap_mb=float(os.environ.get("BENCH_BUCKET_CAP_MB", "25")))
    label = "python"
    if os.environ.get("BENCH_HOOK") == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=int(os.environ.get("BENCH_POWERSGD_RANK", "4")),
                                       start_powerSGD_iter=2)
        net.register_comm_hook(state, powersgd.powerSGD_hook)
        label = "python-powersgd"
    time_training(label, net, model_name, steps, rank, world, optimizer)


if __name__ == "__main__":
    model_name, steps, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    optimizer = sys.argv[4] if len(sys.argv) > 4 else "sgd"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), model_name, steps, port, optimizer)
    else:
        mp.spawn(run, args=(2, model_name, steps, port, optimizer), nprocs=2)
