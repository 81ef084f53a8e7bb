"""Privacy as a type (issue 37): a run is private by construction, and its release chosen once.

A plan holds a ``PrivatePlan`` (no optional field) or none; ``choose_release`` turns that into the
private strategy (the ledger, spend then noise) or the mean, once, and refuses a private plan
without a ledger rather than release without noise. The round's own code asks nothing about
privacy: it has no ``assert`` and no ``type: ignore`` (read from the source, so a regression that
brings an Optional back shows here).
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
from tests.accounting.fakes import LinearLedger

from fedmeta.accounting import TwoStagePoissonScheme
from fedmeta.config_io import load_config
from fedmeta.server import release_strategy
from fedmeta.server import round as round_module
from fedmeta.server.plan import PrivatePlan, build_plan
from fedmeta.server.release_strategy import (
    MeanRound,
    MeanStrategy,
    PrivateRound,
    PrivateStrategy,
    ReleasedRun,
    choose_release,
)

COUNTS = {str(i): 20 for i in range(4)}
BASE = ["federation.participants=4", "sampling.participants_per_round=2",
        "dataset.tasks_per_participant=20", "sampling.task_rate=0.25"]  # fmt: skip


def _never(_round: int) -> bool:
    return False


@pytest.mark.unit
def test_a_plan_is_private_exactly_when_it_holds_a_private_plan() -> None:
    public = build_plan(load_config(None, [*BASE, "privacy.enabled=false"]), COUNTS)
    assert public.privacy is None and not public.private
    private = build_plan(load_config(None, [*BASE, "privacy.noise_multiplier=1.0"]), COUNTS)
    assert private.private and private.privacy is not None
    hints = typing.get_type_hints(PrivatePlan)
    optional = [f.name for f in dataclasses.fields(PrivatePlan)
                if type(None) in typing.get_args(hints[f.name])]  # fmt: skip
    assert optional == ["adaptive"]  # adaptive clipping is a choice (None: a fixed C), not privacy
    assert private.privacy.noise_multiplier == 1.0 and private.privacy.clip > 0


@pytest.mark.unit
def test_the_release_is_chosen_once_from_the_plan() -> None:
    cfg = load_config(None, [*BASE, "privacy.noise_multiplier=1.0"])
    plan = build_plan(cfg, COUNTS)
    ledger = LinearLedger(epsilon_budget=10.0, eps_per_round=0.1, delta=cfg.privacy.delta)
    chosen = choose_release(plan, ledger, ReleasedRun("run", 3, plan.normaliser), None, _never)
    try:
        assert isinstance(chosen, PrivateStrategy)
        scheme = TwoStagePoissonScheme(3, 2, 0.25)  # a round's population: the event follows it
        released = chosen.for_round(scheme, 0, None)
        assert isinstance(released, PrivateRound) and released.private
        assert released.plan.event.scheme == scheme
        assert released.plan.noise_multiplier == plan.privacy.noise_multiplier  # type: ignore[union-attr]
        assert released.clip == cfg.privacy.clip and released.affordable()
    finally:
        chosen.close()
    public = build_plan(load_config(None, [*BASE, "privacy.enabled=false"]), COUNTS)
    mean = choose_release(public, None, ReleasedRun("run", 3, public.normaliser), None, _never)
    assert isinstance(mean, MeanStrategy) and mean.epsilons() == {}
    assert isinstance(mean.for_round(public.scheme, 0, None), MeanRound)
    with pytest.raises(ValueError, match="ledger"):
        choose_release(plan, None, ReleasedRun("run", 3, plan.normaliser), None, _never)


@pytest.mark.unit
@pytest.mark.parametrize("module", [round_module, release_strategy], ids=lambda m: m.__name__)
def test_the_round_asserts_nothing_and_ignores_no_type(module: object) -> None:
    path = Path(str(getattr(module, "__file__", "")))
    source = path.read_text()
    asserts = [n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assert)]
    assert asserts == [], f"{path.name}: assert at lines {asserts}"
    assert "type: ignore" not in source, path.name


@pytest.mark.unit
def test_the_source_check_sees_an_assert() -> None:
    """Negative control: the check above would see an assert if one came back."""
    tree = ast.parse("def f(x):\n    assert x is not None\n")
    assert any(isinstance(n, ast.Assert) for n in ast.walk(tree))
