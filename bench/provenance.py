"""What a bench's numbers were measured on, written into every results file: the machine, the versions
of the packages that did the work, and the commit with any edits to it."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# the packages whose versions can move a bench's numbers; one not installed is recorded as None
PACKAGES = ("torch", "transformers", "tokenizers", "prefect", "datasets", "ray", "trl", "openai", "httpx", "uvicorn")


def machine() -> dict[str, Any]:
    """The platform, CPU, versions and commit this process runs on (call it at the start of a bench: the
    commit and edits that ran, not what the tree holds at its end)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    git = ["git", "-C", str(REPO)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    edited = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    return {
        "platform": platform.platform(),
        # which kernels MKL and oneDNN pick, so the float rounding a run's samples follow
        "cpu": {"model": model, "avx512": " avx512f " in cpuinfo.replace("\n", " ")},
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        **versions,
        "commit": commit,
        # the commit alone is not what ran
        "uncommitted_files": sorted(line[3:] for line in edited.stdout.splitlines()),
    }
