"""Privacy accounting for fedmeta: schemes, per-round events, PLD/RDP composition, planning, ledger.

Imports only the standard library, numpy, scipy and dp-accounting (a test enforces that torch, flwr
and prometheus_client are never loaded). The mathematics is in
``../shared/design/privacy-accounting.md`` and ``docs/privacy.md``.
"""

from accounting.composition import (
    DEFAULT_DISCRETIZATION,
    calibrate_noise_multiplier,
    composed_pld,
    epsilon,
    max_rounds,
    pld_delta,
    round_components,
    round_pld,
    tombs2022_published_epsilon,
)
from accounting.ledger import (
    BudgetExhausted,
    BudgetLedger,
    LedgerCorrupted,
    LedgerError,
    SpendRecord,
)
from accounting.randomness import (
    InsecureSeededSource,
    RandomSource,
    SystemRandomSource,
    bernoulli,
    bernoulli_probability,
    sample_without_replacement,
)
from accounting.sampler import TwoStageSampler
from accounting.schemes import (
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    Scheme,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
)

__all__ = [
    "DEFAULT_DISCRETIZATION",
    "BudgetExhausted",
    "BudgetLedger",
    "FixedSizeScheme",
    "FlatPoissonScheme",
    "GaussianRound",
    "LedgerCorrupted",
    "LedgerError",
    "Scheme",
    "SpendRecord",
    "TwoStageFixedScheme",
    "TwoStagePoissonScheme",
    "TwoStageSampler",
    "calibrate_noise_multiplier",
    "composed_pld",
    "epsilon",
    "max_rounds",
    "pld_delta",
    "round_components",
    "round_pld",
    "tombs2022_published_epsilon",
    "InsecureSeededSource",
    "RandomSource",
    "SystemRandomSource",
    "bernoulli",
    "bernoulli_probability",
    "sample_without_replacement",
]
