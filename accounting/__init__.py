"""Privacy accounting for fedmeta: schemes, per-round events, PLD/RDP composition, planning, ledger.

Imports only the standard library, numpy, scipy and dp-accounting (a test enforces that torch, flwr
and prometheus_client are never loaded). The mathematics is in
``docs/privacy.md`` and in the module docstrings (``accounting.composition``).
"""

from accounting.composition import (
    DEFAULT_DISCRETIZATION,
    RoundModel,
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
    PARTICIPANT_LEVEL_NOT_MEANINGFUL,
    FixedSizeScheme,
    FlatPoissonScheme,
    GaussianRound,
    Scheme,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    participant_level_note,
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
    "RoundModel",
    "PARTICIPANT_LEVEL_NOT_MEANINGFUL",
    "participant_level_note",
]
