"""Where legacy_engine keeps what it makes (the demo model, PTX, toolchains, vocabulary merges, machine probes,
routing counts): one cache folder for the whole package."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir(create: bool = True) -> Path:
    """$LE_CACHE_DIR, else $XDG_CACHE_HOME/legacy_engine, else ~/.cache/legacy_engine; made when `create`."""
    d = os.environ.get("LE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "legacy_engine")
    if create:
        os.makedirs(d, exist_ok=True)
    return Path(d)
