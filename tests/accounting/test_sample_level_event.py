"""Sample-level DP-MAML's round event (issue 53): validation, its record, and its GDP ``mu``."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedmeta.accounting.sample_level import (
    ORDERS,
    ExampleSampling,
    SampleLevelRound,
    gdp_mu,
    split_mu_squared,
)

FLAT = ExampleSampling(participants=1, participants_per_round=1, example_rate=0.01)


def round_of(**changes: Any) -> SampleLevelRound:
    fields: dict[str, Any] = {
        "sampling": FLAT,
        "inner_noise_multiplier": 2.0,
        "outer_noise_multiplier": 3.0,
        "inner_steps": 5,
        "max_appearances": 2,
    }
    fields.update(changes)
    return SampleLevelRound(**fields)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"inner_noise_multiplier": 0.0}, "inner_noise_multiplier must be a finite number > 0"),
        ({"outer_noise_multiplier": math.inf}, "outer_noise_multiplier must be a finite"),
        ({"outer_noise_multiplier": True}, "outer_noise_multiplier must be a finite"),
        ({"inner_steps": 0}, "inner_steps must be an integer >= 1"),
        ({"inner_steps": 2.0}, "inner_steps must be an integer >= 1"),
        ({"max_appearances": True}, "max_appearances must be an integer >= 1"),
        ({"order": "third"}, "order must be one of"),
        ({"order": "second"}, "query_cap must be an integer >= 1"),
        ({"query_cap": 5}, "query_cap must be None for order 'first'"),
        ({"sampling": "flat"}, "sampling must be an ExampleSampling"),
    ],
)
def test_round_refuses_bad_fields_naming_them(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        round_of(**changes)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 0.1), "participants must be an integer >= 1"),
        ((5, 6, 0.1), r"participants_per_round must be <= participants \(5\)"),
        ((5, 5, 1.5), r"example_rate must be a number in \(0, 1\]"),
        ((5, 5, 0.0), r"example_rate must be a number in \(0, 1\]"),
        ((5, 5, math.nan), r"example_rate must be a number in \(0, 1\]"),
    ],
)
def test_sampling_refuses_bad_fields(args: tuple[Any, Any, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExampleSampling(*args)


@pytest.mark.unit
def test_inclusion_probability_is_the_product_of_the_stages() -> None:
    sampling = ExampleSampling(participants=20, participants_per_round=5, example_rate=0.1)
    assert sampling.participant_rate == 0.25
    assert sampling.inclusion_probability == pytest.approx(0.025, rel=1e-15)


@pytest.mark.unit
@pytest.mark.parametrize("event", [round_of(), round_of(order="second", query_cap=15)])
def test_record_round_trips_and_refuses_missing_or_extra_keys(event: SampleLevelRound) -> None:
    data = event.to_dict()
    assert SampleLevelRound.from_dict(data) == event
    for broken in ({k: v for k, v in data.items() if k != "order"}, {**data, "extra": 1}):
        with pytest.raises(ValueError, match="must have exactly the keys"):
            SampleLevelRound.from_dict(broken)
    with pytest.raises(ValueError, match="example_rate must be"):
        SampleLevelRound.from_dict({**data, "sampling": {**data["sampling"], "example_rate": 2}})


@pytest.mark.unit
def test_first_order_mu_is_the_larger_endpoint() -> None:
    # m = 2, K = 5, z_in = 2, z_out = 3: query endpoint (2/3)^2 = 0.444, support 2*5/4 = 2.5.
    assert gdp_mu(round_of()) == pytest.approx(math.sqrt(2.5), rel=1e-15)
    # With a quiet inner loop the outer endpoint decides: (4/1)^2 = 16 against 4*1/100.
    quiet = round_of(
        inner_noise_multiplier=10.0, outer_noise_multiplier=1.0, inner_steps=1, max_appearances=4
    )
    assert gdp_mu(quiet) == pytest.approx(4.0, rel=1e-15)


@pytest.mark.unit
def test_second_order_charges_every_query_gradient_of_the_task() -> None:
    # One support appearance moves the task's 15 clipped query gradients by up to 2 C_out each.
    event = round_of(max_appearances=1, order="second", query_cap=15)
    assert gdp_mu(event) ** 2 == pytest.approx((30 / 3.0) ** 2 + 5 / 4.0, rel=1e-15)
    assert gdp_mu(event) > gdp_mu(round_of(max_appearances=1))


@st.composite
def rounds_strategy(draw: st.DrawFn) -> SampleLevelRound:
    order = draw(st.sampled_from(ORDERS))
    return SampleLevelRound(
        sampling=FLAT,
        inner_noise_multiplier=draw(st.floats(0.05, 50.0)),
        outer_noise_multiplier=draw(st.floats(0.05, 50.0)),
        inner_steps=draw(st.integers(1, 20)),
        max_appearances=draw(st.integers(1, 12)),
        order=order,
        query_cap=draw(st.integers(1, 30)) if order == "second" else None,
    )


@pytest.mark.unit
@settings(max_examples=100, deadline=None)
@given(event=rounds_strategy())
def test_mu_is_the_largest_over_every_split(event: SampleLevelRound) -> None:
    m = event.max_appearances
    every = max(
        split_mu_squared(event, support, query)
        for support in range(m + 1)
        for query in range(m + 1 - support)
    )
    assert gdp_mu(event) ** 2 == pytest.approx(every, rel=1e-12)


@pytest.mark.unit
@settings(max_examples=100, deadline=None)
@given(event=rounds_strategy(), factor=st.floats(1.0, 10.0))
def test_mu_grows_with_appearances_and_steps_and_falls_with_noise(
    event: SampleLevelRound, factor: float
) -> None:
    def changed(**kw: Any) -> SampleLevelRound:
        return SampleLevelRound(**{**vars(event), **kw})

    mu = gdp_mu(event)
    assert gdp_mu(changed(max_appearances=event.max_appearances + 1)) >= mu
    assert gdp_mu(changed(inner_steps=event.inner_steps + 1)) >= mu
    assert gdp_mu(changed(inner_noise_multiplier=event.inner_noise_multiplier * factor)) <= mu
    assert gdp_mu(changed(outer_noise_multiplier=event.outer_noise_multiplier * factor)) <= mu
