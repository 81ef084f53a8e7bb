"""The marks every output of a run carries: PUBLIC WARM START, EXPERIMENT, NON-PRIVATE.

One definition for the summary (server/fedmeta/server/outputs.py), the plots (plots.py) and
``fedmeta evaluate``, so the same model is marked the same way wherever it is reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def marks(*, private: bool, experiment: str | None, public: bool) -> list[str]:
    """The marks every output of a run carries: PUBLIC, EXPERIMENT, NON-PRIVATE.

    The summary, the plots and ``fedmeta evaluate`` print the same marks for the same model.
    """
    out = ["PUBLIC WARM START"] if public else []
    if experiment:
        out.append(f"EXPERIMENT {experiment}")
    if not private:
        out.append("NON-PRIVATE")
    return out


def summary_marks(summary: Mapping[str, Any]) -> list[str]:
    """The marks of a summary, old (without ``marks``) or new."""
    return marks(private=bool(summary["private"]), experiment=summary.get("experiment"),
                 public=bool(summary.get("public_warm_start")))  # fmt: skip
