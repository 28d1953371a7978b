"""Where legacy_engine keeps what it makes (the demo model, PTX, toolchains, vocabulary merges, machine probes,
routing counts): one cache folder for the whole package."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cache_dir(create: bool = True) -> Path:
    """$LE_CACHE_DIR, else $XDG_CACHE_HOME/legacy_engine, else ~/.cache/legacy_engine; made when `create`."""
    d = os.environ.get("LE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "legacy_engine")
    if create:
        os.makedirs(d, exist_ok=True)
    return Path(d)


@contextlib.contextmanager
def written_atomically(out):
    """Yields a temporary path beside `out` (same folder, so the rename cannot cross file systems) for the caller
    to write whole; renamed to `out` when the block ends normally, deleted when it raises (an interrupted
    convert or make-model never leaves a partial file under the real name). The folder is made if missing."""
    out = os.fspath(out)
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(out)}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
