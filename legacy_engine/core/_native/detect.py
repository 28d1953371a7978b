"""What the machine has, as the C core detects it: CPU features (CPUID masked by XGETBV), NUMA nodes (libnuma,
dlopened), GPUs (libcuda, dlopened)."""
from __future__ import annotations

from ._lib import check, ffi, lib, struct_to_dict


def cpu_info() -> dict:
    """CPU vendor, brand, and feature flags (CPUID masked by XGETBV)."""
    p = ffi.new("le_cpu_info *")
    check(lib.le_cpu_detect(p), "le_cpu_detect")
    return struct_to_dict(p)


def numa_info() -> dict:
    p = ffi.new("le_numa_info *")
    check(lib.le_numa_detect(p), "le_numa_detect")
    return struct_to_dict(p)


def gpu_info() -> dict:
    """{'available', 'driver_version', 'device_count', 'reason', 'devices': [...]}"""
    p = ffi.new("le_gpu_driver_info *")
    check(lib.le_gpu_detect(p), "le_gpu_detect")
    info = struct_to_dict(p)
    devices = []
    for i in range(info["device_count"]):
        d = ffi.new("le_gpu_device_info *")
        check(lib.le_gpu_device(i, d), f"le_gpu_device({i})")
        devices.append(struct_to_dict(d))
    info["devices"] = devices
    return info
