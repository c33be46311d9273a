"""Files written whole or not at all, and temp folders that outlive no process for long."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from runtime.processes import pid_alive


def replace_file(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: writers finishing together, or a crash mid-write, never
    leave a half-written file (the last complete writer wins)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)


def owned_temp_folder(prefix: str) -> Path:
    """A new temp folder named by this process (`<prefix><pid>-<random>`); the caller removes it. A process
    killed first (SIGKILL, a deadline) cannot: the next folder of the same prefix removes every one whose
    process no longer runs."""
    temp = Path(tempfile.gettempdir())
    for folder in temp.glob(f"{prefix}*"):
        owner = folder.name.removeprefix(prefix).split("-")[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=temp))
