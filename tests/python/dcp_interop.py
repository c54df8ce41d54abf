"""Sharded checkpoints in PyTorch's DCP Hugging Face layout, lockstep <-> FSDP2.

    python dcp_interop.py TOOL FOLDER

TOOL is lockstep_safetensors_interop (tests/safetensors_interop.cpp), with its
fsdp-save-dcp and fsdp-load-dcp commands. The model on both sides is
Sequential(Linear(5,7), BatchNorm1d(7), Linear(7,3)), after one Adam step,
saved with Adam's state (state.<name>.exp_avg, .exp_avg_sq, .step). Each
check prints a line; the script exits 1 if any failed:
  - lockstep's FSDP saves at 2 ranks a folder whose files all carry
    DCP_SHARDING_INFO, and which loads bitwise equal to lockstep's full state
    and Adam's (a) in this process, with dcp.load and no process group, and
    (b) in FSDP2 (fully_shard) at 3 ranks over gloo, full_tensor() on every
    rank, the optimizer's state through get_optimizer_state_dict;
  - a folder FSDP2 saves at 2 ranks (HuggingFaceStorageWriter,
    save_distributed=True), with its Adam's state, loads in lockstep's FSDP
    and Adam at 3 ranks bitwise;
  - torch's consolidate_safetensors_files turns lockstep's folder into one
    file whose tensors equal lockstep's full state bitwise.
Each child (TOOL, or this script as one rank of a process group) has a
time limit, so a hang is a FAIL line, not a stuck test.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader, HuggingFaceStorageWriter

TIMEOUT = 120  # seconds, for each TOOL run and each group of ranks
ERRORS = (Exception, CheckpointException)  # DCP's exception is a BaseException
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def short(e):
    """An exception in one line: DCP's hold every rank's traceback."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def model():
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3))


def bitwise(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def mismatches(state, ref):
    """Names that differ between a state (plain tensors) and ref, bitwise (a step count: by value); missing or
    extra names too."""
    bad = sorted(set(state) ^ set(ref))
    return bad + [k for k in state if k in ref and not (
        float(state[k]) == float(ref[k]) if k.endswith(".step") else bitwise(state[k], ref[k]))]


def flat_optimizer_state(state):
    """An optimizer state dict's "state" ({name: {key: tensor}}) as DCP names it: state.<name>.<key>, in full."""
    return {f"state.{name}.{key}": (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().contiguous()
            for name, keys in state.items() for key, v in keys.items()}


def zero_adam_state(net):
    """What a fresh Adam's state would be after its first step, as PyTorch's state dict holds it, by name."""
    return {name: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(0.0)}
            for name, p in net.named_parameters()}


def clobber(state):
    """Sets every tensor (the local shard of a DTensor) to -7, so that a load that skips one shows."""
    with torch.no_grad():
        for v in state.values():
            (v.to_local() if hasattr(v, "to_local") else v).fill_(-7)


def run_tool(tool, *args):
    """Runs TOOL; returns None on success, else why it failed. Its output is passed through."""
    try:
        result = subprocess.run([tool, *args], capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        for out in (e.stdout, e.stderr):
            sys.stdout.write(out.decode(errors="replace") if isinstance(out, bytes) else out or "")
        return f"timed out after {TIMEOUT} s"
    except OSError as e:
        return f"cannot run it: {e}"
    sys.stdout.write(result.stdout + result.stderr)
    return None if result.returncode == 0 else f"exit code {result.returncode}"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(folder, job, world, *args):
    """Runs this script as ranks 0..world-1 of a gloo group on a free port. Returns, per rank, None
    if it exited 0, else why not. A failed rank ends the rest; the failed ones' logs are shown."""
    port, procs, logs = free_port(), [], []
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    for rank in range(world):
        logs.append(os.path.join(folder, f"{job}_w{world}_rank{rank}.log"))
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", job, str(rank),
                                           str(world), *args], stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline, why = time.monotonic() + TIMEOUT, [None] * world
    while any(p.poll() is None for p in procs):
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:  # the others would only wait for the lost rank
            for rank, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    why[rank] = "killed, another rank failed" if failed else f"timed out after {TIMEOUT} s"
            break
        time.sleep(0.1)
    for rank, p in enumerate(procs):
        why[rank] = why[rank] or (None if p.returncode == 0 else f"exit code {p.returncode}")
    for rank, log in enumerate(logs):
        if why[rank] and not why[rank].startswith("killed"):
            print(f"  -- rank {rank} of {job}: {why[rank]}; the end of {log}:")
            with open(log, errors="replace") as f:
                sys.stdout.write("".join("     " + line for line in f.readlines()[-8:]) or "     (empty)\n")
    return why


# ----------------------------------------------------------------- ranks (this script run by spawn)

def fsdp2(net, world):
    """Shards net as FSDP2 users do: each Linear, then the whole (which takes BatchNorm's parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net[2], mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def full_state(net):
    """Every tensor of net's state dict in full (full_tensor() is collective: all ranks call it)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().contiguous().clone()
            for k, v in net.state_dict().items()}


def rank_load(rank, world, ckpt, ref):
    """FSDP2 and its Adam load ckpt; every tensor in full must equal ref's. Exits 1 otherwise."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    net = fsdp2(model(), world)
    opt = torch.optim.Adam(net.parameters(), lr=0.5)
    osd = get_optimizer_state_dict(net, opt)  # Adam's state made, as a first step would make it
    state = net.state_dict()
    clobber(state)
    for keys in osd["state"].values():
        clobber(keys)
    dcp.load({**state, "state": osd["state"]}, storage_reader=HuggingFaceStorageReader(ckpt))
    net.load_state_dict(state)
    set_optimizer_state_dict(net, opt, osd)
    loaded = {**full_state(net), **flat_optimizer_state(get_optimizer_state_dict(net, opt)["state"])}
    bad = mismatches(loaded, load_file(ref))
    print(f"rank {rank}: " + (f"differ from the reference: {bad}" if bad else "all tensors bitwise equal"))
    return 1 if bad else 0


def rank_save(rank, world, ckpt, ref):
    """FSDP2 saves a model with non-default weights and BN statistics after one Adam step, with Adam's state
    ({**model state, "state": optimizer state}, as DCP's HF writer takes tensors only); rank 0 writes the
    full state and Adam's to ref."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)  # the same numbers on every rank, before FSDP2 shards them
    net = model()
    with torch.no_grad():
        for p in net.parameters():  # BatchNorm's weight and bias away from 1 and 0 too
            p.add_(torch.randn_like(p))
        net.train()
        net(torch.randn(6, 5) * 2 + 1)  # running statistics far from the defaults
    net = fsdp2(net, world)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.randn(6, 5)).pow(2).sum().backward()
    opt.step()
    osd = get_optimizer_state_dict(net, opt)
    dcp.save({**net.state_dict(), "state": osd["state"]},
             storage_writer=HuggingFaceStorageWriter(ckpt, save_distributed=True))
    full = {**full_state(net), **flat_optimizer_state(osd["state"])}
    if rank == 0:
        save_file(full, ref)
    return 0


def rank_main(job, rank, world, *args):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", rank=int(rank), world_size=int(world), timeout=timedelta(seconds=TIMEOUT // 2))
    try:
        code = {"load": rank_load, "save": rank_save}[job](int(rank), int(world), *args)
        dist.barrier()
    except ERRORS:
        traceback.print_exc()
        code = 1
    dist.destroy_process_group()
    return code


# ----------------------------------------------------------------- the checks

def lockstep_to_python(tool, folder):
    ckpt, ref = os.path.join(folder, "lockstep_w2"), os.path.join(folder, "lockstep_w2_ref.safetensors")
    why = run_tool(tool, "fsdp-save-dcp", ckpt, "2", ref)
    check(why is None, "lockstep's FSDP saves at 2 ranks in DCP HF layout" + (f" ({why})" if why else ""))
    if why:
        return None
    expected = load_file(ref)
    names = sorted(model().state_dict()) + sorted(f"state.{name}.{key}" for name, _ in model().named_parameters()
                                                  for key in ("exp_avg", "exp_avg_sq", "step"))
    check(sorted(expected) == sorted(names),
          f"lockstep's reference holds the model's state-dict names and Adam's ({', '.join(sorted(expected))})")

    files, without = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors")), []
    for name in files:
        with safe_open(os.path.join(ckpt, name), framework="pt") as f:
            info = json.loads((f.metadata() or {}).get("DCP_SHARDING_INFO", "{}"))
            without += [f"{name}:{k}" for k in f.keys() if k not in info]
    check(files and not without, f"lockstep's folder holds {len(files)} safetensors file(s), DCP_SHARDING_INFO "
          f"for every tensor" + (f" (missing {without})" if without else ""))

    try:
        net = model()
        state, optimizer_state = net.state_dict(), zero_adam_state(net)
        clobber(state)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore")
            dcp.load({**state, "state": optimizer_state}, storage_reader=HuggingFaceStorageReader(ckpt))
        bad = mismatches({**state, **flat_optimizer_state(optimizer_state)}, expected)
        check(not bad, "Python, no process group, loads lockstep's folder and Adam's state bitwise"
              + (f" (differ: {bad})" if bad else ""))
    except ERRORS as e:
        check(False, f"Python, no process group, loads lockstep's folder ({short(e)})")

    for rank, why in enumerate(spawn(folder, "load", 3, ckpt, ref)):
        check(why is None, f"FSDP2 and Adam, rank {rank} of 3, load lockstep's 2-rank folder bitwise"
              + (f" ({why})" if why else ""))
    return ckpt, expected


def python_to_lockstep(tool, folder):
    ckpt, ref = os.path.join(folder, "python_w2"), os.path.join(folder, "python_w2_ref.safetensors")
    why = "; ".join(f"rank {rank}: {w}" for rank, w in enumerate(spawn(folder, "save", 2, ckpt, ref)) if w)
    check(not why, "FSDP2 saves at 2 ranks in DCP HF layout" + (f" ({why})" if why else ""))
    if not why:
        why = run_tool(tool, "fsdp-load-dcp", ckpt, "3", ref)
        check(why is None, "lockstep's FSDP and Adam at 3 ranks load FSDP2's 2-rank folder bitwise"
              + (f" ({why})" if why else ""))


def consolidation(folder, ckpt, expected):
    # Only the floating-point tensors: torch 2.15's consolidation sizes elements with
    # torch.finfo(dtype).bits, which raises TypeError for integer and bool tensors, so
    # BatchNorm's int64 num_batches_tracked would fail it (its 0-d data would be skipped too).
    out = os.path.join(folder, "consolidated")
    os.makedirs(out)
    floats = {k: 1 for k, v in expected.items() if v.is_floating_point() and not k.startswith("state.")}
    try:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        consolidate_safetensors_files(ckpt, out, floats)
        bad = mismatches(load_file(os.path.join(out, "model-00001-of-00001.safetensors")),
                         {k: expected[k] for k in floats})
        check(not bad, f"torch consolidates lockstep's folder into one file, {len(floats)} floating-point tensors "
              "bitwise" + (f" (differ: {bad})" if bad else ""))
    except ERRORS as e:
        check(False, f"torch consolidates lockstep's folder ({short(e)})")


def guarded(what, fn, *args):
    """fn's result; an error that no check of fn caught (say, TOOL wrote no REF) becomes a FAIL line."""
    try:
        return fn(*args)
    except ERRORS as e:
        check(False, f"{what} ({short(e)})")


def main():
    tool, folder = sys.argv[1], os.path.abspath(sys.argv[2])
    os.makedirs(folder, exist_ok=True)
    for name in ("lockstep_w2", "lockstep_w2_ref.safetensors", "python_w2", "python_w2_ref.safetensors",
                 "consolidated"):  # an earlier run's shard files would be read with this run's
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    saved = guarded("lockstep to Python", lockstep_to_python, tool, folder)
    guarded("Python to lockstep", python_to_lockstep, tool, folder)
    if saved:
        guarded("consolidation", consolidation, folder, *saved)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(*sys.argv[2:]) if sys.argv[1:2] == ["--rank"] else main())
