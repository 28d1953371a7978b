"""What the kernel says about this process's memory."""
from __future__ import annotations

import numpy as np


def thp_backed_bytes(buf) -> int:
    """Bytes of the mappings overlapping buf that huge pages back now (/proc/self/smaps:
    AnonHugePages + FilePmdMapped + ShmemPmdMapped of each overlapping mapping; 0 if unreadable)."""
    a = np.asarray(buf)
    start = a.__array_interface__["data"][0]
    end = start + a.nbytes
    total, inside = 0, False
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: lo-hi perms ...
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and start < hi
                elif inside and head in ("AnonHugePages:", "FilePmdMapped:", "ShmemPmdMapped:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total
