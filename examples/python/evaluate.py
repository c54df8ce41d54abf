"""Evaluates lockstep-train's model.safetensors in PyTorch, on Fashion-MNIST.

    python examples/python/evaluate.py runs/NAME/model.safetensors
        [--data /usr/share/datasets/fashion-mnist] [--test-samples N]

It builds the trainer's CNN (examples/models.h) in PyTorch under the same
names, loads the weights strictly with Python's safetensors package, reads
the test split as the trainer does (examples/idx.h: pixels / 255, then
MNIST's mean and standard deviation), and prints the test accuracy in the
trainer's words and digits: "test accuracy 91.2%". The first N test samples
with --test-samples, as the trainer's option of that name.
"""

import argparse
import gzip
import os
import struct
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class ConvNet(torch.nn.Module):
    """examples/models.h's ConvNetImpl, layer for layer."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 5, padding=2)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 5, padding=2)
        self.bn2 = torch.nn.BatchNorm2d(32)
        self.fc1 = torch.nn.Linear(32 * 7 * 7, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(F.relu(self.bn2(self.conv2(h))), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


def read_idx(path):
    """An IDX file (gzipped or not) as a uint8 tensor of its shape."""
    if not os.path.exists(path) and os.path.exists(path + ".gz"):
        path += ".gz"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, dims = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        sys.exit(f"evaluate.py: {path} is not an IDX file of bytes")
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    body = data[4 + 4 * dims:]
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(shape)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="model.safetensors that lockstep-train wrote")
    parser.add_argument("--data", default="/usr/share/datasets/fashion-mnist", help="MNIST-format IDX files")
    parser.add_argument("--test-samples", type=int, default=0, help="the first N test samples (0: all)")
    args = parser.parse_args()

    model = ConvNet()
    model.load_state_dict(load_file(args.model), strict=True)
    model.eval()
    images = read_idx(os.path.join(args.data, "t10k-images-idx3-ubyte"))
    labels = read_idx(os.path.join(args.data, "t10k-labels-idx1-ubyte")).long()
    if args.test_samples > 0:
        images, labels = images[:args.test_samples], labels[:args.test_samples]
    x = (images.unsqueeze(1).float() / 255.0 - 0.1307) / 0.3081
    correct = 0
    with torch.no_grad():
        for i in range(0, len(labels), 500):  # the trainer's evaluation batches
            correct += (model(x[i:i + 500]).argmax(1) == labels[i:i + 500]).sum().item()
    print(f"evaluate.py: test accuracy {100.0 * correct / max(1, len(labels)):.1f}% of {args.model} "
          f"on {len(labels)} samples")


if __name__ == "__main__":
    main()
