"""Where mtrl keeps, once per machine, what it can rebuild: $MTRL_CACHE_DIR, else
$XDG_CACHE_HOME/mtrl, else ~/.cache/mtrl. Everything in it is safe to delete."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(
        os.environ.get("MTRL_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtrl"
    )
