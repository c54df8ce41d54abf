"""A model of a DDP, PowerSGD or FullShard step on a ring, checked against
the network lab and projected to 256 ranks (docs/scaling.md).

    python3 bench/scaling_model.py DATA [OUT]

DATA holds what bench/scaling_lab.sh wrote: collectives-RATE.txt (allreduces
of several sizes between 2 hosts), ddp-RATE-P.txt (the measured step rate)
and ddp-RATE-P.json[.gz] (host 0's timeline). OUT (default docs/scaling)
receives, for each projection (lab and 20us), projection-NAME.dat,
scaling-NAME.gp and, with gnuplot, scaling-NAME.png.

The model:
  - a ring allreduce of n bytes on p ranks costs 2(p-1) alpha + 2(p-1)/p n/B,
    an all-gather or reduce-scatter half of each term;
  - alpha and B are fitted on the 2-host allreduces of the profile;
  - backward's buckets become ready when the timeline says, and go out one
    after another, each when it is ready and the previous one is done;
  - the step is forward + max(backward, the last bucket's end) + the
    optimizer + what else the timeline shows between steps.
"""
import glob
import gzip
import json
import math
import os
import re
import statistics
import subprocess
import sys

MIB = 1 << 20


def load_json(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def fit_link(path):
    """alpha (s, per ring step) and B (bytes/s) from 2-rank allreduces, t = 2 alpha + n / B: alpha from the
    smallest (a few KiB: latency alone), B from the slope between the larger ones (TCP at full rate)."""
    points = []
    for line in open(path):
        m = re.search(r"allreduce of ([0-9.e+-]+) MiB .*: ([0-9.]+) ms", line)
        if m:
            points.append((float(m.group(1)) * MIB, float(m.group(2)) / 1e3))
    points.sort()
    alpha = points[0][1] / 2
    (n1, t1), (n2, t2) = points[-2], points[-1]
    return alpha, (n2 - n1) / (t2 - t1), points


# The lab's hosts share this machine's cores, and their links' bytes cost the
# kernel CPU: at 10 Gb/s on 2 hosts the link already runs at what one core
# moves. So on P hosts a link moves at most LAB_CORES / P cores' worth.
LAB_CORES = 2


def lab_bandwidth(link, ceiling, p):
    return min(link, ceiling * LAB_CORES / p)


def ring(n, p, alpha, bandwidth, half=False):
    if p < 2:
        return 0.0
    factor = 1 if half else 2
    return factor * (p - 1) * alpha + factor * (p - 1) / p * n / bandwidth


def profile(path):
    """Medians over the timed steps of rank 0: forward, optimizer, the rest of the step, backward,
    and each bucket's ready offset from backward's start and its bytes."""
    events = [e for e in load_json(path)["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 0]
    forwards = sorted(e["ts"] for e in events if e["name"] == "forward")
    steps = []
    for i in range(6, len(forwards) - 1):  # 5 untimed steps, then the first timed one, are skipped
        lo, hi = forwards[i], forwards[i + 1]
        inside = [e for e in events if lo <= e["ts"] < hi]
        get = lambda name: [e for e in inside if e["name"] == name]
        backward = get("backward")[0]
        buckets = sorted((e for e in inside if e["name"].startswith("allreduce bucket")), key=lambda e: e["ts"])
        steps.append({
            "period": (hi - lo) / 1e6,
            "forward": get("forward")[0]["dur"] / 1e6,
            "backward": backward["dur"] / 1e6,
            "optimizer": sum(e["dur"] for e in get("optimizer step")) / 1e6,
            "copy_out": sum(e["dur"] for e in inside if e["name"].startswith("copy-out")) / 1e6,
            "ready": [(e["ts"] - backward["ts"]) / 1e6 for e in buckets],
            "bytes": [e["args"]["bytes"] for e in buckets],
        })
    med = lambda key: statistics.median(s[key] for s in steps)
    count = statistics.mode(len(s["ready"]) for s in steps)
    same = [s for s in steps if len(s["ready"]) == count]
    out = {k: med(k) for k in ("period", "forward", "backward", "optimizer", "copy_out")}
    out["ready"] = [statistics.median(s["ready"][k] for s in same) for k in range(count)]
    out["bytes"] = [same[0]["bytes"][k] for k in range(count)]
    out["other"] = out["period"] - out["forward"] - out["backward"] - out["optimizer"]
    return out


def ddp_step(prof, p, alpha, bandwidth):
    end = 0.0
    for ready, n in zip(prof["ready"], prof["bytes"]):
        end = max(ready, end) + ring(n, p, alpha, bandwidth)
    backward = max(prof["ready"][-1], end) + prof["copy_out"]
    return prof["forward"] + backward + prof["optimizer"] + prof["other"]


# --- projections: the deep model (48 x Linear(256, 256)), one rank per host, each with the 2-host rank's batch ---
LAYERS = 48
LAYER_BYTES = (256 * 256 + 256) * 4
POWERSGD_RANK = 4
POWERSGD_SECONDS_PER_BYTE = 0.67e-3 / MIB  # its compute: about 5 ms a step for the MLP's 7.5 MB (docs/performance.md)
CAPS_MB = (1, 5, 10, 25, 50, 100)


def layer_ready(compute):
    """Backward's compute spread evenly over the layers, last layer first."""
    d = compute["backward"]
    return [d * (j + 1) / LAYERS for j in range(LAYERS)]


def buckets(cap_bytes, sizes, ready):
    out, n, first = [], 0, True
    for size, r in zip(sizes, ready):
        limit = min(cap_bytes, MIB) if first else cap_bytes
        if n and n + size > limit:
            out.append((last, n))
            n, first = 0, False
        n += size
        last = r
    out.append((last, n))
    return out


def sequential(bucket_list, cost):
    end = 0.0
    for ready, n in bucket_list:
        end = max(ready, end) + cost(n)
    return end


def project_ddp(c, p, alpha, bw, cap_mb):
    ready = layer_ready(c)
    end = sequential(buckets(cap_mb * MIB, [LAYER_BYTES] * LAYERS, ready), lambda n: ring(n, p, alpha, bw))
    return c["forward"] + max(c["backward"], end) + c["optimizer"] + c["other"]


def project_powersgd(c, p, alpha, bw):
    ready = layer_ready(c)
    p_bytes = (256 * POWERSGD_RANK + 256) * 4  # P and the bias, per layer
    q_bytes = 256 * POWERSGD_RANK * 4
    end = sequential(buckets(25 * MIB, [p_bytes] * LAYERS, ready), lambda n: ring(n, p, alpha, bw))
    compress = POWERSGD_SECONDS_PER_BYTE * LAYER_BYTES * LAYERS
    tail = ring(q_bytes * LAYERS, p, alpha, bw)
    return c["forward"] + max(c["backward"], end) + compress + tail + c["optimizer"] + c["other"]


def project_fullshard(c, p, alpha, bw):
    f, b = c["forward"] / LAYERS, c["backward"] / LAYERS
    gather = ring(LAYER_BYTES, p, alpha, bw, half=True)
    scatter = ring(LAYER_BYTES, p, alpha, bw, half=True)
    forward = gather + LAYERS * max(f, gather)            # each gather hidden behind the previous layer
    backward = gather + LAYERS * max(b, gather + scatter) + scatter
    return forward + backward + c["optimizer"] + c["other"]


def main():
    data = sys.argv[1]
    out_dir = sys.argv[2] if len(sys.argv) > 2 else "docs/scaling"
    links = {}
    print("## The lab's links (2-host allreduces, least squares on t = 2 alpha + n / B)")
    for path in sorted(glob.glob(os.path.join(data, "collectives-*.txt"))):
        rate = re.search(r"collectives-(\w+)\.txt", path).group(1)
        alpha, bw, points = fit_link(path)
        links[rate] = (alpha, bw)
        print(f"{rate}: alpha {alpha * 1e6:.0f} us, B {bw * 8 / 1e9:.2f} Gb/s  (" +
              ", ".join(f"{n / MIB:g} MiB {t * 1e3:.2f} ms" for n, t in points) + ")")
    ceiling = max(bw for _, bw in links.values())  # one core's worth, measured on the fastest profile
    print(f"CPU ceiling: {ceiling * 8 / 1e9:.2f} Gb/s per core, so at most {ceiling * 8 / 1e9 * LAB_CORES:.1f} Gb/s "
          f"shared by the hosts")
    print("\n## Predicted against measured (deep model, one rank per host)")
    print("| link | hosts | measured | predicted | error |\n|---|---|---|---|---|")
    worst = 0.0
    profiles = {}
    for path in sorted(glob.glob(os.path.join(data, "ddp-*-*.txt"))):
        rate, p = re.search(r"ddp-(\w+)-(\d+)\.txt", path).groups()
        p = int(p)
        measured = 1 / float(re.search(r"steps_per_s=([0-9.]+)", open(path).read()).group(1))
        timeline = glob.glob(os.path.join(data, f"ddp-{rate}-{p}.json*"))[0]
        prof = profiles[(rate, p)] = profile(timeline)
        alpha, bw = links[rate]
        predicted = ddp_step(prof, p, alpha, lab_bandwidth(bw, ceiling, p))
        error = (predicted - measured) / measured
        worst = max(worst, abs(error))
        print(f"| {rate} | {p} | {measured * 1e3:.1f} ms | {predicted * 1e3:.1f} ms | {error * 100:+.1f}% |")
    print(f"\nworst error {worst * 100:.1f}%")
    # Compute from the slowest link's 2-host run, whose timeline is the least crowded by the network's CPU.
    slowest = min(links, key=lambda rate: links[rate][1])
    compute = dict(profiles[(slowest, 2)])
    compute["backward"] = compute["ready"][-1]  # backward's compute: until the last bucket is ready
    os.makedirs(out_dir, exist_ok=True)
    # The lab's per-step latency (its slowest profile's: the cleaner small-message figure), and a datacenter
    # fabric's, to show what the bandwidth terms alone do.
    for name, alpha in (("lab", links[slowest][0]), ("20us", 20e-6)):
        project(compute, alpha, name, out_dir)


def project(compute, alpha, name, out_dir):
    alone = compute["forward"] + compute["backward"] + compute["optimizer"] + compute["other"]
    print(f"\n## Projection, alpha {alpha * 1e6:.0f} us (compute of a 2-host rank: {alone * 1e3:.1f} ms)")
    print("| ranks | link | DDP (best bucket_cap_mb) | PowerSGD | FullShard |\n|---|---|---|---|---|")
    rows = []
    for p in (8, 16, 32, 64, 128, 256):
        row = [p]
        for gbps in (10, 25, 100):
            bw = gbps * 1e9 / 8
            ddp = {cap: project_ddp(compute, p, alpha, bw, cap) for cap in CAPS_MB}
            cap = min(ddp, key=ddp.get)
            psgd = project_powersgd(compute, p, alpha, bw)
            fs = project_fullshard(compute, p, alpha, bw)
            print(f"| {p} | {gbps} Gb/s | {alone / ddp[cap] * 100:.0f}% ({cap} MB) | {alone / psgd * 100:.0f}% | "
                  f"{alone / fs * 100:.0f}% |")
            row += [alone / ddp[cap], alone / psgd, alone / fs]
        rows.append(row)
    with open(os.path.join(out_dir, f"projection-{name}.dat"), "w") as f:
        f.write("# ranks, then DDP PowerSGD FullShard efficiency at 10, 25 and 100 Gb/s\n")
        for row in rows:
            f.write(" ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row) + "\n")
    plot(out_dir, name, alpha)


def plot(out_dir, name, alpha):
    methods = ("DDP", "PowerSGD", "FullShard")
    lines = []
    for i, gbps in enumerate((10, 25, 100)):
        for j, method in enumerate(methods):
            col = 2 + 3 * i + j
            lines.append(f"'projection-{name}.dat' using 1:(100*${col}) with linespoints dt {i + 1} lc {j + 1} "
                         f"title '{method}, {gbps} Gb/s'")
    script = (f"set terminal pngcairo size 900,560\nset output 'scaling-{name}.png'\nset logscale x 2\n"
              "set xlabel 'ranks (one per host)'\nset ylabel 'scaling efficiency (%)'\nset yrange [0:105]\n"
              "set key outside right\n"
              f"set title 'Deep model (48 x Linear(256, 256)), ring collectives, alpha {alpha * 1e6:.0f} us'\n"
              "plot " + ", \\\n     ".join(lines) + "\n")
    with open(os.path.join(out_dir, f"scaling-{name}.gp"), "w") as f:
        f.write(script)
    try:
        subprocess.run(["gnuplot", f"scaling-{name}.gp"], cwd=out_dir, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"scaling_model: no plot ({e}); run gnuplot {out_dir}/scaling-{name}.gp")


if __name__ == "__main__":
    main()
