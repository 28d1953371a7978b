"""`python -m legacy_engine.gpu {build,toolchains,ptxas,install-toolchains,info}`; ``cli_build`` is the
``legacy-engine build-kernels`` entry point."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..core.errors import EngineError, UnavailableError
from .kernels import Kernels
from .runtime import available, device_arch, init
from .toolchain import (KernelBuildError, build_kernels, default_variants, find_ptxas, find_toolchains,
                        install_toolchains, ptxas_table, variant_name)


def _print_records(records: list[dict]) -> None:
    for r in records:
        v = variant_name(r["tier"], r["arch"])
        if "skipped" in r:
            print(f"  {r['name']:<14} {v:<12} skipped: {r['skipped']}")
        else:
            print(f"  {r['name']:<14} {v:<12} {r['toolchain']:<11} {r['bytes']:>8} B  {r['ptx']}")


def cli_build(argv: list[str] | None = None) -> int:
    """`legacy-engine build-kernels` / `python -m legacy_engine.gpu build`."""
    p = argparse.ArgumentParser(prog="legacy-engine build-kernels",
                                description="Build cuda8/*.cu to PTX for every tier (cached; --out also writes a "
                                            "folder usable as $LE_PTX_DIR).")
    p.add_argument("--arch", type=int, help="compute capability x10 (35, 61, 70, 90 …); default: the legacy "
                                            "variants plus 75 and 90 where a toolchain can")
    p.add_argument("--toolchain", default="auto", help="auto, nvcc, nvrtc, or a name such as nvrtc-11.8")
    p.add_argument("--out", help="copy the PTX and a manifest.json into this folder")
    p.add_argument("--strict", action="store_true", help="fail when a variant cannot be built")
    a = p.parse_args(argv)
    try:
        records = build_kernels(a.arch, a.toolchain, a.out, skip_missing=not a.strict)
    except (UnavailableError, KernelBuildError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    _print_records(records)
    built = sum("ptx" in r for r in records)
    print(f"{built} PTX built or cached, {len(records) - built} skipped" + (f"; folder {a.out}" if a.out else ""))
    return 0 if built else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m legacy_engine.gpu")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build PTX (build -h)", add_help=False)
    sub.add_parser("toolchains", help="list the compilers and assemblers found")
    s = sub.add_parser("ptxas", help="assemble the legacy PTX for sm_35/61/70 and print registers / smem")
    s.add_argument("--json", help="also write the rows to this file")
    sub.add_parser("install-toolchains", help="pip-install the NVRTC and ptxas wheels under the cache")
    sub.add_parser("info", help="the device, and which variants load on it")
    if argv and argv[0] == "build":
        return cli_build(argv[1:])
    a = p.parse_args(argv)
    if a.cmd == "toolchains":
        for t in find_toolchains():
            print(f"{t.name:<12} compute_{t.archs[0]}…{t.archs[-1]}  {t.path}")
        for v, path in find_ptxas():
            print(f"ptxas-{v[0]}.{v[1]:<6} {path}")
        return 0
    if a.cmd == "install-toolchains":
        print(install_toolchains())
        return 0
    if a.cmd == "ptxas":
        rows = ptxas_table()
        print(f"{'variant':<12} {'ptxas':<5} {'kernel':<22} {'regs':>4} {'smem':>6} {'spill':>6}")
        for r in rows:
            print(f"{r['variant']:<12} {r['ptxas']:<5} {r['kernel']:<22} {r['regs']:>4} {r['smem']:>6} "
                  f"{r['spill_stores'] + r['spill_loads']:>6}")
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
        return 0
    if a.cmd == "info":
        ok, why = available()
        if not ok:
            print(f"no GPU: {why}")
            return 1
        dev = init()
        arch = device_arch()
        print(f"{dev['name']} sm_{arch}, {dev['total_mem'] / 2**30:.1f} GiB")
        for tier, va in default_variants(native_archs=(arch,)):
            if va > arch:
                print(f"  {variant_name(tier, va):<12} not runnable on sm_{arch}")
                continue
            try:
                k = Kernels(tier, va)
                print(f"  {k.name:<12} {k.probe()}  ({k.origins['gemv_f32']})")
            except EngineError as e:
                print(f"  {variant_name(tier, va):<12} unavailable: {str(e)[:200]}")
        return 0
    return 1

