"""What a deployment test reads back from a ledger: the rounds each run spent."""

from __future__ import annotations

from pathlib import Path


def ledger_spends(path: Path) -> dict[str, list[int]]:
    """Run id -> round indices spent, over every federation in the ledger (read-only).

    Empty while the ledger is missing or being created (a test polls it during a run).
    """
    from fedmeta.accounting import BudgetLedger, LedgerError

    out: dict[str, list[int]] = {}
    try:
        for fid in BudgetLedger.describe(path).federations:
            book = BudgetLedger.open_readonly(path, fid)
            try:
                for record in book.records():
                    out.setdefault(record.run_id, []).append(record.round_index)
            finally:
                book.close()
    except (LedgerError, OSError):
        return {}
    return out
