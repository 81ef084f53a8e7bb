"""Sampling randomness: CSPRNG and test sources, exact samplers, and the two-stage sampler's law."""

from __future__ import annotations

import ast
import itertools
import math
import pickle
import random
from collections import Counter
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from fedmeta.accounting import (
    InsecureSeededSource,
    RandomSource,
    SystemRandomSource,
    TwoStageFixedScheme,
    TwoStagePoissonScheme,
    TwoStageSampler,
    bernoulli,
    bernoulli_probability,
    sample_without_replacement,
)

ACCOUNTING = Path(__file__).resolve().parents[2] / "accounting" / "fedmeta" / "accounting"
# Statistical tests run on fixed seeds (deterministic); a p-value below this fails.
ALPHA = 1e-4


class ScriptedSource:
    """A source that replays given bytes: checks exact thresholds and the rejection rule."""

    secure = False

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self.requests: list[int] = []

    def random_bytes(self, n: int) -> bytes:
        self.requests.append(n)
        chunk = next(self._chunks)
        assert len(chunk) == n, (len(chunk), n)
        return chunk

    def randbelow(self, n: int) -> int:  # pragma: no cover - not used by bernoulli
        raise AssertionError("not scripted")


# ----------------------------------------------------------------------------------- sources


@pytest.mark.unit
def test_system_source_is_secure_stateless_and_not_reproducible() -> None:
    a, b = SystemRandomSource(), SystemRandomSource()
    assert a.secure and isinstance(a, RandomSource)
    assert not hasattr(a, "__dict__")  # __slots__ = (): no state that could be saved
    # 256 bits: equal outputs would mean a broken CSPRNG (probability 2**-256).
    assert a.random_bytes(32) != b.random_bytes(32)
    assert a.random_bytes(32) != a.random_bytes(32)
    clone = pickle.loads(pickle.dumps(a))
    assert clone.random_bytes(32) != a.random_bytes(32)  # a copy replays nothing


@pytest.mark.unit
def test_insecure_source_is_reproducible_per_seed_and_stream_and_says_so() -> None:
    def draw(seed: int, stream: int | str) -> tuple[bytes, int, bytes]:
        s = InsecureSeededSource(seed, stream)
        return s.random_bytes(40), s.randbelow(10**30), s.random_bytes(3)

    assert draw(7, 0) == draw(7, 0)
    assert draw(7, 0) != draw(7, 1) != draw(8, 1)
    assert draw(7, "0") != draw(7, 0)  # int and str streams are distinct keys
    assert draw(1, 23) != draw(12, 3)  # no collision by concatenation
    source = InsecureSeededSource(3, stream=5)
    assert not source.secure and isinstance(source, RandomSource)
    assert "INSECURE" in repr(source) and "tests only" in repr(source)
    assert "INSECURE" in (InsecureSeededSource.__doc__ or "")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: InsecureSeededSource(-1), "seed must be an integer >= 0; got -1"),
        (lambda: InsecureSeededSource(True), "seed must be an integer"),
        (lambda: InsecureSeededSource(1, -2), "stream must be an integer >= 0"),
        (lambda: SystemRandomSource().randbelow(0), "n must be an integer >= 1; got 0"),
        (lambda: bernoulli(SystemRandomSource(), 3, 1.5), "p must be a number in \\[0, 1\\]"),
        (lambda: bernoulli(SystemRandomSource(), -1, 0.5), "n must be an integer >= 0"),
        (lambda: bernoulli(object(), 3, 0.5), "source must be a RandomSource"),  # type: ignore[arg-type]
        (
            lambda: sample_without_replacement(SystemRandomSource(), 3, 4),
            "k must be <= population \\(3\\); got 4",
        ),
    ],
)
def test_errors_name_the_field(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


# ------------------------------------------------------------------------------- exact laws


@pytest.mark.unit
def test_bernoulli_threshold_is_exactly_floor_p_times_2_to_64() -> None:
    p = 0.3
    t = math.floor(Fraction(p) * 2**64)
    words = np.array([t - 1, t, 0, 2**64 - 1], dtype="<u8")
    source = ScriptedSource([words.tobytes()])
    assert bernoulli(source, 4, p).tolist() == [True, False, True, False]
    assert bernoulli_probability(p) == Fraction(t, 2**64) == Fraction(p)  # exact for p >= 2**-11
    # Below 2**-64 the floor is 0: never included. The real rate is below the accounted one.
    assert bernoulli_probability(1e-20) == 0
    tiny = bernoulli(ScriptedSource([bytes(8 * 5)]), 5, 1e-20)
    assert not tiny.any()
    assert bernoulli(SystemRandomSource(), 5, 1.0).all()
    assert not bernoulli(SystemRandomSource(), 5, 0.0).any()


@pytest.mark.unit
@settings(max_examples=200, deadline=None, derandomize=True)
@given(p=st.floats(min_value=0.0, max_value=1.0))
def test_bernoulli_probability_never_exceeds_p(p: float) -> None:
    prob = bernoulli_probability(p)
    assert prob <= Fraction(p)
    assert Fraction(p) - prob < Fraction(1, 2**64)
    if p >= 2**-11:
        assert prob == Fraction(p)


@pytest.mark.unit
def test_randbelow_rejects_instead_of_reducing_modulo() -> None:
    # n = 3 needs 2 bits: 0b11 = 3 is rejected and redrawn (modulo would map it to 0, biasing 0).
    source = InsecureSeededSource(0)
    scripted = ScriptedSource([bytes([0b11]), bytes([0b11]), bytes([0b10])])
    assert InsecureSeededSource.randbelow.__qualname__  # the method under test exists
    from fedmeta.accounting.randomness import _randbelow

    assert _randbelow(scripted.random_bytes, 3) == 2
    assert scripted.requests == [1, 1, 1]
    counts = Counter(source.randbelow(7) for _ in range(70_000))
    assert sorted(counts) == list(range(7))
    assert stats.chisquare([counts[i] for i in range(7)]).pvalue > ALPHA


@pytest.mark.unit
def test_sample_without_replacement_is_uniform_over_ordered_subsets() -> None:
    source = InsecureSeededSource(11)
    draws = 60_000
    counts = Counter(tuple(sample_without_replacement(source, 5, 2)) for _ in range(draws))
    assert len(counts) == 20  # all ordered pairs of distinct items
    assert all(a != b for a, b in counts)
    assert stats.chisquare(list(counts.values())).pvalue > ALPHA
    assert sample_without_replacement(source, 4, 0) == []
    assert sorted(sample_without_replacement(source, 4, 4)) == [0, 1, 2, 3]
    big = sample_without_replacement(source, 10**18, 5)  # O(k) memory for a huge population
    assert len(set(big)) == 5 and all(0 <= v < 10**18 for v in big)


# ------------------------------------------------------------------------------ the sampler


def _subset_counts(
    sampler: TwoStageSampler, counts: dict[str, int], rounds: int
) -> tuple[Counter[frozenset[str]], Counter[tuple[str, tuple[int, ...]]]]:
    stage1: Counter[frozenset[str]] = Counter()
    stage2: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for _ in range(rounds):
        out = sampler.sample(counts)
        stage1[frozenset(out)] += 1
        for pid, tasks in out.items():
            stage2[(pid, tuple(tasks))] += 1
    return stage1, stage2


@pytest.mark.unit
def test_two_stage_fixed_law_chi_square() -> None:
    scheme = TwoStageFixedScheme(
        participants=5, participants_per_round=2, tasks_per_round=3, min_tasks=5
    )
    counts = {f"p{i}": 5 for i in range(5)}
    sampler = TwoStageSampler(scheme, InsecureSeededSource(20261123))
    stage1, stage2 = _subset_counts(sampler, counts, 20_000)
    # Stage 1: each of the C(5, 2) = 10 pairs with probability 1/10.
    assert len(stage1) == 10
    assert stats.chisquare(list(stage1.values())).pvalue > ALPHA
    # Stage 2, given a participant: each of the C(5, 3) = 10 task subsets with probability 1/10.
    for pid in counts:
        row = [stage2[(pid, c)] for c in itertools.combinations(range(5), 3)]
        assert sum(row) == sum(n for s, n in stage1.items() if pid in s)
        assert stats.chisquare(row).pvalue > ALPHA
    # Marginal inclusion of a participant is n1 / P = 0.4 (binomial test).
    hits = sum(n for s, n in stage1.items() if "p0" in s)
    assert stats.binomtest(hits, 20_000, 0.4).pvalue > ALPHA


@pytest.mark.unit
def test_two_stage_poisson_law_chi_square_and_empty_lists() -> None:
    q2 = 0.3
    scheme = TwoStagePoissonScheme(participants=4, participants_per_round=3, task_rate=q2)
    counts = {"a": 3, "b": 3, "c": 3, "d": 0}
    sampler = TwoStageSampler(scheme, InsecureSeededSource(7, stream="poisson"))
    rounds = 20_000
    stage1, stage2 = _subset_counts(sampler, counts, rounds)
    assert stats.chisquare(list(stage1.values())).pvalue > ALPHA and len(stage1) == 4
    # Every stage-1 participant appears, with an empty list when it drew no task ("d" always).
    assert stage2[("d", ())] == sum(n for s, n in stage1.items() if "d" in s) > 0
    # Stage 2 joint law over the 2**3 patterns: independent inclusions at rate q2.
    for pid in "abc":
        patterns = list(itertools.chain.from_iterable(
            itertools.combinations(range(3), r) for r in range(4)
        ))  # fmt: skip
        observed = [stage2[(pid, p)] for p in patterns]
        total = sum(observed)
        expected = [total * q2 ** len(p) * (1 - q2) ** (3 - len(p)) for p in patterns]
        assert stats.chisquare(observed, expected).pvalue > ALPHA
        included = sum(len(p) * n for p, n in zip(patterns, observed, strict=True))
        assert stats.binomtest(included, 3 * total, q2).pvalue > ALPHA


@pytest.mark.unit
def test_secure_sampler_marginals_and_non_reproducibility() -> None:
    # Not seeded, so the threshold is loose (a false failure has probability ~1e-9).
    scheme = TwoStagePoissonScheme(participants=6, participants_per_round=2, task_rate=0.25)
    sampler = TwoStageSampler(scheme, SystemRandomSource())
    assert sampler.secure
    counts = {f"p{i}": 4 for i in range(6)}
    rounds = 6000
    picked = Counter(pid for _ in range(rounds) for pid in sampler.sample(counts))
    for pid in counts:
        assert stats.binomtest(picked[pid], rounds, 2 / 6).pvalue > 1e-9
    big = {f"p{i}": 1 for i in range(1000)}
    s1 = TwoStageSampler(TwoStagePoissonScheme(1000, 20, 0.5), SystemRandomSource())
    s2 = TwoStageSampler(TwoStagePoissonScheme(1000, 20, 0.5), SystemRandomSource())
    assert [sorted(s1.sample(big)) for _ in range(3)] != [sorted(s2.sample(big)) for _ in range(3)]
    seeded = [TwoStageSampler(scheme, InsecureSeededSource(5, stream=r)) for r in (0, 0)]
    assert [seeded[0].sample(counts) for _ in range(3)] == [
        seeded[1].sample(counts) for _ in range(3)
    ]
    assert not seeded[0].secure


@pytest.mark.unit
def test_sampler_checks_and_has_no_state_to_checkpoint() -> None:
    scheme = TwoStageFixedScheme(5, 2, 3, 4)
    sampler = TwoStageSampler(scheme, InsecureSeededSource(1))
    with pytest.raises(ValueError, match="min_tasks"):
        sampler.check_task_counts({"small": 3})
    with pytest.raises(ValueError, match="at least participants_per_round"):
        sampler.sample({"only": 5})
    with pytest.raises(ValueError, match="must be >= tasks_per_round"):
        sampler.sample({"a": 5, "b": 2})
    with pytest.raises(ValueError, match="source must be a RandomSource"):
        TwoStageSampler(scheme, np.random.default_rng(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source must be a RandomSource"):
        TwoStageSampler(scheme, None)  # type: ignore[arg-type]
    assert not hasattr(sampler, "state") and not hasattr(TwoStageSampler, "from_state")


@pytest.mark.unit
def test_sampling_never_touches_global_generators() -> None:
    import torch

    np_state = np.random.get_state()
    torch_state = torch.random.get_rng_state().clone()
    py_state = random.getstate()
    counts = {f"p{i}": 6 for i in range(8)}
    for source in (SystemRandomSource(), InsecureSeededSource(3)):
        for scheme in (TwoStagePoissonScheme(8, 3, 0.5), TwoStageFixedScheme(8, 3, 2, 6)):
            sampler = TwoStageSampler(scheme, source)
            for _ in range(50):
                sampler.sample(counts)
            bernoulli(source, 100, 0.2)
            sample_without_replacement(source, 100, 10)
    after = np.random.get_state()
    assert np_state[0] == after[0] and np.array_equal(np_state[1], after[1])
    assert np_state[2:] == after[2:]
    assert torch.equal(torch_state, torch.random.get_rng_state())
    assert random.getstate() == py_state


# Calls and imports that seed or draw from a PRNG: none may appear in accounting/.
_FORBIDDEN_MODULES = ("random", "numpy.random", "torch", "secrets")
_FORBIDDEN_PREFIXES = ("np.random", "numpy.random", "torch.", "random.", "secrets.")
_FORBIDDEN_NAMES = {
    "default_rng",
    "RandomState",
    "PCG64",
    "PCG64DXSM",
    "MT19937",
    "Philox",
    "SFC64",
    "SeedSequence",
    "manual_seed",
}
_FORBIDDEN_ATTRIBUTES = _FORBIDDEN_NAMES | {"seed"}  # np.random.seed, torch.seed, random.seed


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _prng_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(_FORBIDDEN_MODULES)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            _FORBIDDEN_MODULES
        ):
            found.append(str(node.module))
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name.startswith(_FORBIDDEN_PREFIXES) or node.attr in _FORBIDDEN_ATTRIBUTES:
                found.append(name)
        elif isinstance(node, ast.Name) and node.id in _FORBIDDEN_NAMES:
            found.append(node.id)
    return found


@pytest.mark.unit
def test_no_prng_seeding_or_draws_anywhere_in_accounting() -> None:
    # The checker itself catches what it must (so an empty result below means something).
    bad = "import numpy as np\nrng = np.random.default_rng(1)\nimport torch\ntorch.manual_seed(0)\n"
    assert len(_prng_uses(ast.parse(bad))) >= 3
    offenders = {
        path.name: uses
        for path in sorted(ACCOUNTING.glob("*.py"))
        if (uses := _prng_uses(ast.parse(path.read_text(), filename=str(path))))
    }
    assert offenders == {}
