#!/usr/bin/env python3
"""Draws one training step of a lockstep timeline as a self-contained HTML
page (inline SVG), for a screenshot with headless Chromium: Perfetto and
chrome://tracing need a network or a browser UI, which a headless machine
has not.

    bench/timeline_to_html.py TIMELINE.json OUT.html [STEP]

TIMELINE.json: `lockstep-run --timeline FILE`'s merged trace. STEP: which of
rank 0's forwards to start from (default: the last but one). The window runs
from that forward to the end of the following optimizer step on every rank.
Stdlib only.
"""
import html
import json
import sys

COLORS = {
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "copy-in": "#59a14f",
    "allreduce": "#e15759",
    "copy-out": "#b07aa1",
    "optimizer step": "#9c755f",
}


def kind(name):
    for k in COLORS:
        if name.startswith(k):
            return k
    return None


WIDTH, LEFT, ROW_H, TOP = 1300, 200, 40, 60


def step_window(spans, step):
    """The time window of DDP step `step` (rank 0's forwards, counted from 0;
    None: the second to last): from its forward to the end of every rank's
    first optimizer step after it, with a margin of 2% on each side."""
    forwards = sorted(e["ts"] for e in spans if e["pid"] == 0 and e["name"] == "forward")
    step = step if step is not None else max(0, len(forwards) - 2)
    start = forwards[step]
    end = start
    for pid in sorted({e["pid"] for e in spans}):  # each rank's first optimizer step after its forward
        own = sorted(e["ts"] for e in spans if e["pid"] == pid and e["name"] == "forward" and e["ts"] >= start - 20000)
        steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                       if e["pid"] == pid and e["name"] == "optimizer step" and own and e["ts"] > own[0])
        if steps:
            end = max(end, steps[0][1])
    start -= (end - start) * 0.02
    end += (end - start) * 0.02
    return start, end


def layout_rows(window):
    """The rows to draw, as (pid, tid, label, keep): one per rank and track,
    the rank's own thread first, then "collectives"."""
    rows = sorted({(e["pid"], e["tid"]) for e in window}, key=lambda r: (r[0], r[1] >= 1000, r[1]))
    # Copy-ins are many, short, and on the same thread as backward: a row of their own.
    rows_out = []
    for pid, tid in rows:
        if tid >= 1000:  # the collectives track: a row per bucket, since their allreduces overlap
            names = sorted({e["name"] for e in window if e["pid"] == pid and e["tid"] == tid},
                           key=lambda n: int(n.rsplit(" ", 1)[1]) if n.rsplit(" ", 1)[1].isdigit() else 0)
            for n in names:
                rows_out.append((pid, tid, n, lambda e, n=n: e["name"] == n))
            continue
        rows_out.append((pid, tid, "compute", lambda e: kind(e["name"]) not in ("copy-in",)))
        if any(e["pid"] == pid and e["tid"] == tid and kind(e["name"]) == "copy-in" for e in window):
            rows_out.append((pid, tid, "copy-in", lambda e: kind(e["name"]) == "copy-in"))
    return rows_out


def draw_rows(svg, rows_out, window, start, scale):
    for i, (pid, tid, label, keep) in enumerate(rows_out):
        y = TOP + i * ROW_H
        svg.append(f'<rect x="0" y="{y}" width="{WIDTH}" height="{ROW_H}" fill="{"#f4f4f4" if pid % 2 else "#ffffff"}"/>')
        svg.append(f'<text x="10" y="{y + ROW_H / 2 + 4}">rank {pid}: {html.escape(label)}</text>')
        for e in window:
            if e["pid"] != pid or e["tid"] != tid or not keep(e):
                continue
            x0 = LEFT + max(0.0, (e["ts"] - start) * scale)
            x1 = LEFT + min(WIDTH - LEFT - 20, (e["ts"] + e["dur"] - start) * scale)
            w = max(1.0, x1 - x0)
            k = kind(e["name"])
            inner = 8 if k in ("copy-in", "copy-out") else 4
            svg.append(f'<rect x="{x0:.1f}" y="{y + inner}" width="{w:.1f}" height="{ROW_H - 2 * inner}" fill="{COLORS[k]}" '
                       f'opacity="0.9"><title>{html.escape(e["name"])}: {e["dur"] / 1000:.2f} ms</title></rect>')
            text = e["name"]
            if "bytes" in e.get("args", {}) and k == "allreduce":
                text += f' ({e["args"]["bytes"] / 2**20:.1f} MiB)'
            if w > 7 * len(text):
                svg.append(f'<text x="{x0 + 4:.1f}" y="{y + ROW_H / 2 + 4}" fill="white">{html.escape(text)}</text>')


def draw_axis_and_legend(svg, axis_y, span_ms, scale):
    svg.append(f'<line x1="{LEFT}" y1="{axis_y}" x2="{WIDTH - 20}" y2="{axis_y}" stroke="black"/>')
    tick = next(t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if span_ms / t <= 12)
    t = 0
    while t <= span_ms:
        x = LEFT + t * 1000 * scale
        svg.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 5}" stroke="black"/>')
        svg.append(f'<text x="{x - 8:.1f}" y="{axis_y + 18}">{t} ms</text>')
        t += tick
    legend_x = LEFT
    for k, c in COLORS.items():
        svg.append(f'<rect x="{legend_x}" y="32" width="12" height="12" fill="{c}"/>')
        svg.append(f'<text x="{legend_x + 16}" y="43">{k}</text>')
        legend_x += 30 + 8 * len(k)


def main():
    events = json.load(open(sys.argv[1]))["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and kind(e["name"])]
    start, end = step_window(spans, int(sys.argv[3]) if len(sys.argv) > 3 else None)
    # Longest first, so that short spans (copy-out, at backward's end) are drawn on top.
    window = sorted((e for e in spans if e["ts"] + e["dur"] >= start and e["ts"] <= end), key=lambda e: -e["dur"])
    rows_out = layout_rows(window)
    ranks = len({r[0] for r in rows_out})
    scale = (WIDTH - LEFT - 20) / (end - start)
    height = TOP + ROW_H * len(rows_out) + 70
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="DejaVu Sans" font-size="12">',
           f'<text x="10" y="22" font-size="16" font-weight="bold">lockstep timeline: one DDP step on {ranks} ranks '
           f'({(end - start) / 1000:.1f} ms shown)</text>']
    draw_rows(svg, rows_out, window, start, scale)
    # Time axis.
    draw_axis_and_legend(svg, TOP + ROW_H * len(rows_out) + 20, (end - start) / 1000, scale)
    svg.append("</svg>")
    with open(sys.argv[2], "w") as out:
        out.write('<!doctype html><html><body style="margin:0">' + "\n".join(svg) + "</body></html>\n")


if __name__ == "__main__":
    main()
