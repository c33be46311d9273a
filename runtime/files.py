"""Files written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: writers finishing together, or a crash mid-write, never
    leave a half-written file (the last complete writer wins)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)
