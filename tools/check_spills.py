#!/usr/bin/env python3
"""Fail when a CUDA kernel spills registers to local memory, or when ptxas serialises its wgmma products.

Usage: check_spills.py BUILD_LOG_OR_BINARY [...]
  - a text build log holding ptxas -v reports (the flashmonoid target compiles with -Xptxas=-v):
    every "Compiling entry function 'K' for 'sm_XX'" is followed by "... bytes spill stores,
    ... bytes spill loads"; any nonzero count fails, and so does a C7515 report ("wgmma.mma_async
    instructions are serialized"): every product of that kernel then waits for the one before it
    (a forward that left an S product in flight across a branch measured 25-30% slower, H100);
  - a library or object (.a, .so, .o): `cuobjdump -res-usage` lists each kernel's LOCAL bytes per
    thread; nonzero LOCAL (spills or a stack array) fails. Its SASS is read as well, the check that
    needs no build log: a kernel with more than one `WARPGROUP.DEPBAR` per two HGMMA has its
    products serialised (products issued under a runtime branch, ptxas's C7520: every one of 36
    HGMMA got its own wait, 28-30% slower on the H100; the library's kernels have 0.07-0.17 waits
    per HGMMA).
Prints one line per offending kernel (demangled when c++filt is available) and a summary."""
import re
import shutil
import subprocess
import sys

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
SERIAL = re.compile(r"\(C75\d\d\) Potential Performance Loss: wgmma.*? in the function '([^']+)'")
RES = re.compile(r"Function ([^\s:]+):\s*\n\s*REG:[^\n]*?LOCAL:(\d+)")  # the usage is on the line after the name


def demangle(names):
    if not names or not shutil.which("c++filt"):
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return out.splitlines() or names


def from_log(path):
    # The log may accumulate several builds (make appends): the last report of each
    # (kernel, arch) is the one that describes the current binary.
    latest, serial, current = {}, {}, None
    with open(path, errors="replace") as f:
        for line in f:
            m = SERIAL.search(line)
            if m:
                serial[m.group(1)] = line.split("Potential Performance Loss: ")[1].split(" in the function")[0]
                continue
            m = ENTRY.search(line)
            if m:
                current = m.groups()
                continue
            m = SPILL.search(line)
            if m and current:
                latest[current] = tuple(map(int, m.groups()))
                current = None
    bad = [(k, f"{arch}: {st} B spill stores, {ld} B spill loads")
           for (k, arch), (st, ld) in latest.items() if st or ld]
    bad += [(k, why) for k, why in serial.items()]
    return len(latest), bad


def from_binary(path):
    tool = shutil.which("cuobjdump")
    if not tool:
        sys.exit("check_spills: cuobjdump not found (needed to read " + path + ")")
    text = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
    kernels, bad = 0, []
    for m in RES.finditer(text):
        kernels += 1
        if int(m.group(2)):
            bad.append((m.group(1), f"{m.group(2)} B local memory per thread"))
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    bad += serialised_in_sass(sass)
    return kernels, bad


def serialised_in_sass(sass):
    """(kernel, why) for each function of a cuobjdump -sass listing whose wgmma waits outnumber half
    its HGMMA instructions."""
    counts, name = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            counts[name] = [0, 0]
        elif name is not None:
            counts[name][0] += "HGMMA" in line
            counts[name][1] += "WARPGROUP.DEPBAR" in line
    return [(k, f"wgmma serialised: {d} WARPGROUP.DEPBAR for {h} HGMMA") for k, (h, d) in counts.items()
            if h and 2 * d > h]


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    total, offenders = 0, []
    for path in sys.argv[1:]:
        n, bad = from_binary(path) if re.search(r"\.(a|so|o)$", path) else from_log(path)
        total += n
        offenders += bad
    names = demangle([k for k, _ in offenders])
    for name, (_, why) in zip(names, offenders):
        print(f"{'SPILL' if 'spill' in why else 'SERIALIZED'} {why}  {name}")
    if total == 0:
        sys.exit("check_spills: no kernel reports found (build with -Xptxas=-v, or pass the library)")
    print(f"check_spills: {total} kernel compilations, {len(offenders)} with spills or serialised wgmma")
    sys.exit(1 if offenders else 0)


if __name__ == "__main__":
    main()
