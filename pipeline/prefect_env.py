"""Prefect settings mtrl needs, applied before `import prefect` (see shared/notes/prefect.md).

Defaults only (a user's own environment wins): telemetry off, PREFECT_HOME inside the runs
directory instead of ~/.prefect, a startup timeout that survives a first migration on a
slow machine, and no warnings from stage functions called outside a flow.
"""

from __future__ import annotations

import os
from pathlib import Path


def configure(runs_dir: str | Path) -> None:
    home = Path(runs_dir).resolve() / ".prefect"
    defaults = {
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "PREFECT_UI_ENABLED": "false",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Stages log their own one-line summaries; per-save progress bars are noise.
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    # the libraries read their variables at import, which may have happened already
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
