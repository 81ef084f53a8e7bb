"""Strict configuration: every field takes only its own type, from a file or from ``--set``.

A bool is not an int (``--set rounds=true`` once ran one round) and a string is not a number (a
TOML ``epsilon_budget = "8"`` was accepted); ``--set`` values are parsed for the field they set.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmeta.config import Config, ConfigError
from fedmeta.config_io import load_config

REFUSED_OVERRIDES = [
    ("rounds=true", "rounds must be an integer"),
    ("rounds=1e3", "rounds must be an integer"),
    ("rounds='200'", "rounds must be an integer"),
    ("seed=false", "seed must be an integer"),
    ("privacy.epsilon_budget=true", "privacy.epsilon_budget must be a number"),
    ("privacy.epsilon_budget='8'", "privacy.epsilon_budget must be a number"),
    ("privacy.epsilon_budget=eight", "privacy.epsilon_budget must be a number"),
    ("privacy.noise_multiplier=true", "privacy.noise_multiplier must be a number"),
    ("privacy.enabled=1", "privacy.enabled must be true or false"),
    ("privacy.enabled=yes", "privacy.enabled must be true or false"),
    ("federation.participants=10.0", "federation.participants must be an integer"),
    ("federation.node_keys=3", "federation.node_keys must be a table"),
    ("training.first_order=0", "training.first_order must be true or false"),
]


@pytest.mark.unit
@pytest.mark.parametrize(("override", "needle"), REFUSED_OVERRIDES)
def test_set_refuses_another_type_in_one_line_naming_field_and_fix(
    override: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    text = str(caught.value)
    assert needle in text and "\n" not in text
    assert "without quotes" in text or "true or false" in text or "table" in text


@pytest.mark.unit
def test_set_parses_each_value_for_its_field() -> None:
    cfg = load_config(
        None,
        [
            "privacy.epsilon_budget=8",  # an integer is a valid float
            "rounds=12",
            "dataset.name=omniglot",
            "dataset.path=2024",  # a folder named 2024: text, not a number
            'output.dir="runs/with space"',  # TOML quotes are dropped
            "privacy.noise_multiplier=none",
            "federation.node_keys={ a = 'k' }",
        ],
    )
    assert cfg.privacy.epsilon_budget == 8.0 and isinstance(cfg.privacy.epsilon_budget, float)
    assert cfg.rounds == 12 and cfg.dataset.path == "2024"
    assert cfg.output.dir == "runs/with space" and cfg.privacy.noise_multiplier is None
    assert cfg.federation.node_keys == {"a": "k"}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('[privacy]\nepsilon_budget = "8"\n', "privacy.epsilon_budget must be a number"),
        ("rounds = true\n", "rounds must be an integer"),
        ("rounds = 2.0\n", "rounds must be an integer"),
        ('[privacy]\nenabled = "false"\n', "privacy.enabled must be true or false"),
        ("[dataset]\npath = 7\n", "dataset.path must be text"),
        # TOML dates: no field holds one, and none reaches validation as an internal error.
        ("[privacy]\ndelta = 1979-05-27\n", "privacy.delta must be a number"),
        ("[privacy]\nwhen = 1979-05-27T07:32:00Z\n", "privacy.when unknown key"),
    ],
)
def test_a_file_with_another_type_is_refused(tmp_path: Path, toml: str, needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=needle):
        load_config(path)


@pytest.mark.unit
def test_every_field_is_strict() -> None:
    # A field added later inherits strictness from the sections' shared settings.
    sections = [Config, *(f.annotation for f in Config.model_fields.values())]
    for section in sections:
        if isinstance(section, type) and hasattr(section, "model_config"):
            assert section.model_config.get("strict") is True, section


@pytest.mark.unit
def test_a_checkpointed_config_reads_back_strictly() -> None:
    # Resume reads the configuration from the checkpoint's JSON: it must still validate.
    cfg = load_config(None, ["privacy.epsilon_budget=3", "rounds=7"])
    assert Config.model_validate_json(cfg.model_dump_json()) == cfg


@pytest.mark.integration
@pytest.mark.parametrize(
    ("extra", "budget"),
    [
        # noise_multiplier = 1e-4 once left a checkpoint of 0 rounds and exit status 0.
        (["privacy.noise_multiplier=1e-4"], 100.0),
        (["privacy.noise_multiplier=1.0"], 0.05),  # a budget below one round's cost
    ],
)
def test_a_run_that_would_complete_no_round_refuses_before_it_starts(
    tmp_path: Path, extra: list[str], budget: float
) -> None:
    from fedmeta.server.startup import NoRoundAffordable

    from .fakes import fake_ledger
    from .test_round import run, small

    out = tmp_path / "out"
    # The fake ledger prices a round at 1e3 (the real accountant: 5.5e7 at z = 1e-4), or at 0.1.
    ledger = fake_ledger(budget, 0.1 if budget < 1 else 1e3)
    with pytest.raises(NoRoundAffordable, match="the budget affords no round") as caught:
        run(small("rounds=2", *extra), out, ledger)
    assert "privacy.noise_multiplier" in str(caught.value) and "\n" not in str(caught.value)
    assert not out.exists() and ledger.position() == 0


@pytest.mark.unit
def test_a_ray_address_selects_the_ray_backend_or_is_refused_beside_in_process(
    tmp_path: Path,
) -> None:
    """With the in-process default, `federation.ray_address` alone was ignored: the documented
    command ran on this machine, not on the cluster."""
    from fedmeta.config_io import config_from_dict
    from fedmeta.simulation.simulate import main as simulate

    assert load_config(None, []).federation.backend == "inprocess"
    alone = load_config(None, ["federation.ray_address='10.0.0.1:6379'"]).federation
    assert (alone.backend, alone.ray_address) == ("ray", "10.0.0.1:6379")
    assert load_config(None, ["federation.ray_address=' '"]).federation.ray_address is None
    # A saved configuration states its backend; one written before the rule still loads (for
    # evaluate, or a resume with backend = 'ray'), and a run refuses the contradiction.
    saved = Config().to_dict()
    saved["federation"]["ray_address"] = "h:1"
    both = config_from_dict(saved)
    assert (both.federation.backend, both.federation.ray_address) == ("inprocess", "h:1")
    with pytest.raises(ConfigError) as caught:
        simulate(both, out_dir=tmp_path / "run")
    text = str(caught.value)
    assert "federation.ray_address needs federation.backend = 'ray'" in text and "\n" not in text
    assert not (tmp_path / "run").exists()  # refused before anything was written
