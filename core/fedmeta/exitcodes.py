"""Exit statuses of the ``fedmeta`` commands (documented in docs/reliability.md).

Distinct, so that scripts and orchestrators can tell a bad command line from a spent budget, an
interrupted run and a bug.
"""

from typing import Final

OK: Final = 0  #: finished: the planned rounds ran, or the budget ran out after at least one round
INTERNAL_ERROR: Final = 1  #: a bug or an unexpected failure; rerun with FEDMETA_DEBUG=1 for detail
BAD_INPUT: Final = 2  #: configuration, checkpoint, data, ledger or output directory refused
BUDGET_EXHAUSTED: Final = 3  #: the budget allowed not a single round: nothing was run
UNAVAILABLE: Final = 4  #: too few participants registered, or the output directory is in use
INTERRUPTED: Final = 130  #: SIGINT/SIGTERM: no round left half-done, a final checkpoint written
