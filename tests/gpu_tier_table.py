"""Every GPU test on every tier variant, in one command, as one table (issue 5's proof, run on the GPU machine).

    LE_PTX_DIR=DIR python tests/gpu_tier_table.py [--out table.md] [-- extra pytest args]

Runs `pytest -m gpu tests/test_gpu.py tests/test_gpu_model.py tests/test_gpu_vision.py` with LE_GPU_STRICT=1 (a variant that cannot be built
fails instead of skipping), reads its JUnit XML, and prints a markdown table: one row per test (kernel or whole-model
check), one column per variant (fermi-sm35, kepler-sm35, dp4a-sm61, dp4a-sm70 and the card's own arch per tier),
each cell "passed/total" of that test's parameter cases on that variant; tests that take no variant go in the
last column. The header names the date, the GPU, the driver and the PTX origins. Exit status: pytest's.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANT = re.compile(r"(fermi|kepler|dp4a)-sm(\d+)")


def run(extra: list[str]) -> tuple[int, Path]:
    xml = Path(tempfile.mkdtemp()) / "gpu.xml"
    env = dict(os.environ, LE_GPU_STRICT="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}",
           str(HERE / "test_gpu.py"), str(HERE / "test_gpu_model.py"), str(HERE / "test_gpu_vision.py")] + extra
    rc = subprocess.run(cmd, env=env, cwd=HERE.parent).returncode
    return rc, xml


def table(xml: Path) -> tuple[list[str], dict, dict]:
    cells: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    failures: dict[str, list[str]] = defaultdict(list)
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "")
        base, _, params = name.partition("[")
        m = VARIANT.search(params)
        col = f"{m.group(1)}-sm{m.group(2)}" if m else "(no variant)"
        if case.find("skipped") is not None:
            continue
        c = cells[base][col]
        c[1] += 1
        if case.find("failure") is None and case.find("error") is None:
            c[0] += 1
        else:
            failures[base].append(name)
    cols = sorted({c for row in cells.values() for c in row},
                  key=lambda c: (c == "(no variant)", ["fermi", "kepler", "dp4a"].index(c.split("-")[0])
                                 if "-" in c else 9, int(c.split("sm")[-1]) if "sm" in c else 0))
    return cols, cells, failures


def header() -> str:
    try:
        from legacy_engine.core import _native
        from legacy_engine import gpu
        info = _native.gpu_info()
        dev = gpu.init()
        drv = info.get("driver_version")
        drv_s = f"{drv // 1000}.{drv % 1000 // 10}" if isinstance(drv, int) else str(drv)
        return f"{datetime.date.today()}, {dev['name']} (sm_{gpu.device_arch()}), CUDA driver API {drv_s}"
    except Exception as e:  # noqa: BLE001 - the table still prints
        return f"{datetime.date.today()}, GPU unknown ({e})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the markdown table to this file")
    ap.add_argument("extra", nargs="*", help="after --: more pytest arguments")
    a = ap.parse_args(argv)
    rc, xml = run(a.extra)
    cols, cells, failures = table(xml)
    lines = [f"GPU tier table — {header()}; PTX from {os.environ.get('LE_PTX_DIR') or 'the build cache'}", "",
             "| test | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for base in sorted(cells):
        row = cells[base]
        lines.append(f"| {base} | " + " | ".join(
            (f"{row[c][0]}/{row[c][1]}" + ("" if row[c][0] == row[c][1] else " ✗")) if c in row else "–"
            for c in cols) + " |")
    tot = [sum(cells[b][c][0] for b in cells if c in cells[b]) for c in cols]
    all_ = [sum(cells[b][c][1] for b in cells if c in cells[b]) for c in cols]
    lines.append("| **all** | " + " | ".join(f"**{p}/{t}**" for p, t in zip(tot, all_)) + " |")
    for base, names in failures.items():
        lines.append(f"failed: {', '.join(names[:5])}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n", encoding="utf-8")
    return rc


if __name__ == "__main__":
    sys.exit(main())
