"""Safetensors between lockstep and Python's safetensors package, both ways.

    python safetensors_interop.py TOOL FOLDER

TOOL is tests/safetensors_interop.cpp's program. Each check prints a line;
the script exits 1 if any failed:
  - every dtype that lockstep writes reads in Python bitwise, and every dtype
    Python writes reads in lockstep bitwise (a byte pattern both sides make);
  - a CNN with BatchNorm saved by Python (model.state_dict()) gives, in
    LibTorch, Python's outputs within 1e-6, and the other way round.
"""

import os
import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E8M0": torch.float8_e8m0fnu,
}

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def pattern(name, i):
    """Tensor i of the patterns, as safetensors_interop.cpp makes it."""
    dtype = DTYPES[name]
    nbytes = 15 * torch.empty((), dtype=dtype).element_size()
    modulus = 2 if name == "BOOL" else 251
    raw = torch.tensor([(31 * k + 7 * i) % modulus for k in range(nbytes)], dtype=torch.uint8)
    return raw.view(dtype).reshape(3, 5)


def run(tool, *args):
    result = subprocess.run([tool, *args], capture_output=True, text=True)
    sys.stdout.write(result.stdout + result.stderr)
    return result.returncode == 0


def patterns_both_ways(tool, folder):
    from_cpp = os.path.join(folder, "patterns_cpp.safetensors")
    check(run(tool, "write-patterns", from_cpp), "lockstep writes every dtype")
    with safe_open(from_cpp, framework="pt") as f:
        names = f.metadata()["dtypes"].split(",")
        check(f.metadata().get("format") == "pt", "lockstep's file says format pt")
    check(sorted(names) == sorted(DTYPES), f"lockstep writes every dtype Python has ({len(names)})")
    read = load_file(from_cpp)
    for i, name in enumerate(names):
        expected = pattern(name, i)
        got = read[f"t_{name}"]
        check(got.dtype == expected.dtype and got.shape == expected.shape
              and torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), f"Python reads lockstep's {name} bitwise")
    from_python = os.path.join(folder, "patterns_python.safetensors")
    save_file({f"t_{name}": pattern(name, i) for i, name in enumerate(names)}, from_python)
    check(run(tool, "check-patterns", from_python), "lockstep reads Python's file bitwise, every dtype")


def cnn():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))


def cnn_both_ways(tool, folder):
    torch.manual_seed(0)
    model = cnn()
    model(torch.randn(16, 1, 8, 8) * 2 + 1)  # running statistics far from the defaults
    model.eval()
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        y = model(x)
    python_model = os.path.join(folder, "cnn_python.safetensors")
    python_io = os.path.join(folder, "cnn_python_io.safetensors")
    save_file(model.state_dict(), python_model)
    save_file({"x": x, "y": y}, python_io)
    check(run(tool, "cnn-check", python_model, python_io), "Python's CNN evaluated in LibTorch within 1e-6")

    cpp_model = os.path.join(folder, "cnn_cpp.safetensors")
    cpp_io = os.path.join(folder, "cnn_cpp_io.safetensors")
    check(run(tool, "cnn-save", cpp_model, cpp_io), "lockstep saves its CNN")
    other = cnn()
    other.load_state_dict(load_file(cpp_model), strict=True)
    other.eval()
    io = load_file(cpp_io)
    with torch.no_grad():
        diff = (other(io["x"]) - io["y"]).abs().max().item()
    check(diff <= 1e-6, f"lockstep's CNN evaluated in Python within 1e-6 (largest difference {diff:.3g})")


def main():
    tool, folder = sys.argv[1], sys.argv[2]
    os.makedirs(folder, exist_ok=True)
    patterns_both_ways(tool, folder)
    cnn_both_ways(tool, folder)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
