"""Static check of a Hopper kernel's SASS: in each hot loop (a backward conditional branch whose body issues HGMMA),
no instruction may write a register that an HGMMA group in flight reads as its A operand, before the
``WARPGROUP.DEPBAR.LE gsb0, n`` that retires the group. The loop is walked as a cycle, so a write at the top of the
next pass counts. This is how the eighth session found why ``wgws`` with one group in flight gave wrong results at
BM 256: the rolled loop decoded every step into the registers the step before's wgmma was still reading.

    python3 benchmarks/sass_race.py k.sass     # from gluon_ws.py / gluon_probe.py --compile (their $OUT)
"""
from __future__ import annotations

import re
import sys

# instructions whose first register operand is not a destination
_NO_DEST = ("HGMMA", "ST", "RED", "ATOM", "BRA", "SYNCS", "BAR", "WARPGROUP", "ISETP", "FSETP", "HSETP", "DSETP")


def _parse(sass: str) -> list[tuple[int, str]]:
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+([^;]*);", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).strip()))
    return out


def _written(ins: str) -> set[int]:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    op, _, rest = ins.partition(" ")
    m = re.match(r"R(\d+)", rest.strip())
    if op.startswith(_NO_DEST) or not m:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or "WIDE" in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def hot_loops(code: list[tuple[int, str]], mark: str = "HGMMA") -> list[tuple[int, int]]:
    """(first, last) indices of loops that issue ``mark`` (HGMMA: wgmma loops): a predicated backward branch over a
    body with no EXIT or unconditional branch (mbarrier retry stubs jump back from the end of the code
    unconditionally)."""
    at = {a: i for i, (a, _) in enumerate(code)}
    loops = []
    for i, (a, ins) in enumerate(code):
        m = re.search(r"BRA 0x([0-9a-f]+)", ins)
        if not (m and ins.startswith("@") and int(m.group(1), 16) < a):
            continue
        first = at[int(m.group(1), 16)]
        body = [x for _, x in code[first:i]]
        if any(mark in x for x in body) and not any(x.startswith(("EXIT", "BRA")) for x in body):
            loops.append((first, i))
    return loops


def loop_spills(sass: str) -> list[str]:
    """Every local-memory access (a register spill: STL/LDL) in the innermost hot loops (the K loops; an outer loop
    over tiles also holds the epilogue), as 'address instruction' lines."""
    code = _parse(sass)
    loops = hot_loops(code)
    inner = [(f, l) for f, l in loops if not any((f, l) != (g, h) and f <= g and h <= l for g, h in loops)]
    return [f"{a:#06x} {ins}" for first, last in inner for a, ins in code[first:last + 1]
            if re.search(r"\b(STL|LDL)", ins)]


def races(sass: str) -> list[str]:
    """Every write to an in-flight HGMMA A operand in the hot loops, as 'address instruction' lines."""
    code = _parse(sass)
    found = []
    for first, last in hot_loops(code):
        body = code[first:last + 1]
        n = len(body)
        groups, cur = [], []  # per group: (index, A registers) of its HGMMAs; gsb0 closes a group
        for j, (_, ins) in enumerate(body):
            m = re.search(r"HGMMA\S* R\d+, R(\d+),", ins)
            if m:
                cur.append((j, set(range(int(m.group(1)), int(m.group(1)) + 4))))
            if "HGMMA" in ins and "gsb0" in ins:
                groups.append(cur)
                cur = []
        for g in filter(None, groups):
            newer, last = 0, g[-1][0]
            for j in range(g[0][0] + 1, last + 1 + n):  # from the group's first HGMMA, at most once around the loop
                ins = body[j % n][1]
                if j > last and "HGMMA" in ins and "gsb0" in ins:
                    newer += 1
                m = re.search(r"DEPBAR.LE gsb0, 0x(\d+)", ins)
                if j > last and m and newer >= int(m.group(1)):
                    break  # the group is retired
                hit = _written(ins) & set().union(*(regs for k, regs in g if k < j))
                if hit:
                    found.append(f"{body[j % n][0]:#06x} {ins}  (writes R{min(hit)}, read by a wgmma in flight)")
    return found


if __name__ == "__main__":
    bad = races(open(sys.argv[1]).read())
    print("\n".join(bad) or "no write to an in-flight wgmma operand")
    sys.exit(1 if bad else 0)
