"""Where benchmark reports go: JSON files in ``bench/results/`` next to earlier ones."""

from __future__ import annotations

import json
import time
from pathlib import Path


def save_report(name: str, report: dict, directory: Path = Path("bench/results")) -> Path | None:
    """Write the report next to earlier ones when run from the repository; None elsewhere."""
    if not directory.is_dir():
        return None
    path = directory / f"{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path
