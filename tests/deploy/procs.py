"""Process checks the deployment tests share."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an ended process its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
