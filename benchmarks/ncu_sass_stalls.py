"""Where a kernel's warps wait, per SASS instruction, from ncu's source page.

Input: the CSV of ``ncu --import R.ncu-rep --page source --print-source sass --csv`` for a report
taken with ``--section WarpStateStats --section SourceCounters`` (benchmarks/ncu_sass.sh makes
one), plain or gzipped. Prints the share of warp samples per instruction class (the per-record
barrier, the copy and mbarrier waits, the wgmma issue and retire, the decode's integer work, the
epilogue's memory traffic...), then the instructions that hold the most samples with their top
stall reasons, so that "the warps wait at X for Y" can be read off one launch. The code is also cut
into segments at each EXIT, RET and CALL (a kernel's body, each non-inlined function), with their
shares of the samples and of the warp instructions executed; --ranges sums chosen index ranges (the
phases of one function: the indices are those the top list prints). Session 25 found v4's
128-token escape pass this way (15 % of gate_up's instructions in one non-inlined function).

Usage: python benchmarks/ncu_sass_stalls.py FILE.csv[.gz] [--top 25] [--ranges A-B,C-D] [--json OUT]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import re
import sys
from collections import defaultdict

# Instruction classes by SASS opcode (the first word after an optional predicate). The order
# matters: the first pattern that matches names the class.
CLASSES = [
    ("barrier", r"^(BAR|BSYNC|WARPSYNC|BSSY)"),
    ("mbarrier", r"^SYNCS"),
    ("cp.async wait", r"^(LDGDEPBAR|DEPBAR)"),
    ("wgmma issue", r"^HGMMA"),
    ("wgmma retire", r"^WARPGROUP"),
    ("copy issue", r"^(LDGSTS|UBLKCP|UTMALDG|UTMAPF|UBLKPF)"),
    ("shared load", r"^(LDS|LDSM)"),
    ("shared store", r"^(STS|STSM)"),
    ("global load", r"^(LDG|LD\b|LDC|ULDC)"),
    ("global store", r"^(STG|ST\b|RED|ATOM)"),
    ("fence", r"^(FENCE|MEMBAR|CCTL)"),
    ("float", r"^(FADD|FMUL|FFMA|F2F|I2F|F2I|FSET|FSETP|FMNMX|HADD2|HMUL2|HFMA2)"),
    (
        "integer",
        r"^(LOP3|PRMT|SHF|IMAD|IADD3|LEA|SEL|ISETP|IMNMX|MOV|UMOV|ULOP3|UIADD3|USHF|UPRMT|ULEA|UISETP|USEL|IABS|POPC|FLO|S2R|S2UR|CS2R|R2UR|UIMAD|VOTEU|VOTE|SHFL|PLOP3|P2R|R2P)",
    ),
    ("branch", r"^(BRA|EXIT|RET|CALL|BPT|NOP|YIELD|ELECT|ACQBULK)"),
]


def classify(sass: str) -> str:
    op = re.sub(r"^@!?U?P[T0-9]+\s+", "", sass.strip())
    for name, pat in CLASSES:
        if re.match(pat, op):
            return name
    return "other"


def read_rows(path: str) -> tuple[str, list[dict]]:
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    with raw as f:
        text = f.read()
    lines = text.splitlines()
    # ncu prints the kernel name on a line of its own, then the header.
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f'{path}: no source-page header ("Address", ...): not ncu\'s --page source --csv output')
    name = [c for c in next(csv.reader([lines[start - 1]])) if c][-1] if start else ""
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    return name, rows


def num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


_SAMPLES = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"
_SEGMENT_END = re.compile(r"^(EXIT|RET|CALL)\b")


def _totals(rows: list[dict]) -> tuple[float, float]:
    """All samples and all warp instructions executed (1.0 where none, to divide by)."""
    return (sum(num(r[_SAMPLES]) for r in rows) or 1.0, sum(num(r.get(_EXECUTED, "")) for r in rows) or 1.0)


def _span(rows: list[dict], lo: int, hi: int, totals: tuple[float, float]) -> dict:
    """Instructions lo..hi (inclusive): their shares of all samples and of all warp instructions executed."""
    total, executed = totals
    part = rows[lo : hi + 1]
    return {
        "first": lo,
        "last": hi,
        "share": sum(num(x[_SAMPLES]) for x in part) / total,
        "executed": sum(num(x.get(_EXECUTED, "")) for x in part) / executed,
    }


def segments(rows: list[dict]) -> list[dict]:
    """The code cut after each EXIT, RET and CALL (predicated ones too): each piece's span and the
    instruction that ends it."""
    out, start, totals = [], 0, _totals(rows)
    for i, r in enumerate(rows):
        op = re.sub(r"^@!?U?P[T0-9]+\s+", "", r["Source"].strip())
        if _SEGMENT_END.match(op) or i == len(rows) - 1:
            out.append({**_span(rows, start, i, totals), "ends": op})
            start = i + 1
    return out


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """Parses "A-B,C-D" into [(A, B), (C, D)] (inclusive); ValueError naming the bad item."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        lo, sep, hi = item.partition("-")
        if not sep or not lo.isdigit() or not hi.isdigit() or int(lo) > int(hi):
            raise ValueError(f"--ranges: {item!r} is not FIRST-LAST (instruction indices, FIRST <= LAST)")
        out.append((int(lo), int(hi)))
    return out


def analyse(rows: list[dict], top: int) -> dict:
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(num(r[_SAMPLES]) for r in rows) or 1.0
    by_class: dict[str, float] = defaultdict(float)
    class_reasons: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    insts = []
    for i, r in enumerate(rows):
        s = num(r[_SAMPLES])
        c = classify(r["Source"])
        by_class[c] += s
        rs = {k[6:]: num(r[k]) for k in reasons if num(r[k])}
        for k, v in rs.items():
            class_reasons[c][k] += v
        insts.append((s, i, r["Source"].strip(), c, rs))
    by_reason: dict[str, float] = defaultdict(float)
    for c in class_reasons.values():
        for k, v in c.items():
            by_reason[k] += v
    out = {
        "samples": total,
        "reasons": {k: v / total for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])},
        "classes": {
            c: {"share": v / total, "reasons": dict(sorted(class_reasons[c].items(), key=lambda kv: -kv[1])[:3])}
            for c, v in sorted(by_class.items(), key=lambda kv: -kv[1])
        },
        "top": [],
    }
    for s, i, src, c, rs in sorted(insts, reverse=True)[:top]:
        # The instruction a stalled warp waits *at* is the one it has not issued yet; the cause is
        # often the instruction before (a barrier's wait shows on the instruction after BAR).
        prev = rows[i - 1]["Source"].strip() if i else ""
        out["top"].append(
            {
                "index": i,
                "share": s / total,
                "sass": src,
                "class": c,
                "previous": prev,
                "reasons": dict(sorted(rs.items(), key=lambda kv: -kv[1])[:3]),
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu source-page CSV (.csv or .csv.gz)")
    p.add_argument("--top", type=int, default=25, help="instructions to list (most samples first)")
    p.add_argument("--ranges", default="", help="also sum these instruction index ranges, e.g. 11837-11940,11941-12157")
    p.add_argument("--json", help="also write the summary here")
    a = p.parse_args(argv)
    try:
        ranges = parse_ranges(a.ranges)
    except ValueError as e:
        print(f"ncu_sass_stalls: {e}", file=sys.stderr)
        return 2
    try:
        name, rows = read_rows(a.csv)
    except (OSError, ValueError) as e:
        print(f"ncu_sass_stalls: {e}", file=sys.stderr)
        return 2
    if not rows or _SAMPLES not in rows[0]:
        print(
            f"{a.csv}: no warp-stall sampling columns (take the report with --section SourceCounters)", file=sys.stderr
        )
        return 2
    res = analyse(rows, a.top)
    res["kernel"] = name
    res["segments"] = segments(rows)
    bad = [f"{lo}-{hi}" for lo, hi in ranges if hi >= len(rows)]
    if bad:
        print(f"ncu_sass_stalls: --ranges {','.join(bad)} past the last instruction ({len(rows) - 1})", file=sys.stderr)
        return 2
    totals = _totals(rows)
    res["ranges"] = [_span(rows, lo, hi, totals) for lo, hi in ranges]
    print(f"{name[:160]}\n{int(res['samples'])} samples, {len(rows)} instructions")
    print("\nby stall reason (a barrier wait shows on the instruction after BAR):")
    print("  " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in list(res["reasons"].items())[:8]))
    print("\nby class of the instruction waited at:")
    for c, v in res["classes"].items():
        rs = ", ".join(f"{k} {int(n)}" for k, n in v["reasons"].items())
        print(f"  {c:14s} {100 * v['share']:5.1f} %   ({rs})")
    print("\ntop instructions (share, index, SASS  <-  previous; top reasons):")
    for t in res["top"]:
        rs = ", ".join(f"{k} {int(n)}" for k, n in t["reasons"].items())
        print(f"  {100 * t['share']:5.1f} % #{t['index']:<5d} {t['sass'][:60]:60s} <- {t['previous'][:40]:40s} {rs}")
    print("\nby segment (cut after each EXIT, RET, CALL; >= 0.5 % of the samples or instructions):")
    for g in res["segments"]:
        if g["share"] >= 0.005 or g["executed"] >= 0.005:
            print(
                f"  #{g['first']:<5d}-#{g['last']:<5d} samples {100 * g['share']:5.1f} %  instructions "
                f"{100 * g['executed']:5.1f} %  ends {g['ends'][:40]}"
            )
    for g in res["ranges"]:
        print(
            f"  range #{g['first']}-#{g['last']}: samples {100 * g['share']:5.1f} %  instructions {100 * g['executed']:5.1f} %"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
