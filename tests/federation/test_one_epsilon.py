"""One epsilon everywhere, and no sub-day time released (issue 39, item 6).

The summary, ``fedmeta evaluate --json`` and the exporter report the same number, the implemented
guarantee (the accountant's epsilon with the release's floating-point residual folded in), to 1e-9.
The lock file and the exporter publish no time finer than a day.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fedmeta.cli import main
from fedmeta.server.rundir import LOCK_NAME

from .test_round import SMALL


@pytest.mark.integration
def test_summary_evaluate_and_exporter_report_one_epsilon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from prometheus_client import generate_latest

    from fedmeta.server.monitoring.ledger import exporter_registry

    out = tmp_path / "runs" / "a"
    sets = [
        w
        for s in [
            *SMALL,
            "rounds=3",
            "output.plots=false",
            "output.progress=false",
            f"privacy.ledger_path={tmp_path / 'l.sqlite'}",
        ]
        for w in ("--set", s)
    ]
    assert main(["simulate", "--out", str(out), *sets]) == 0
    summary = json.loads((out / "summary.json").read_text())
    implemented = summary["implemented_guarantee"]["epsilon"]
    assert implemented > summary["epsilon_spent"]  # the residual is folded in: another number
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(out), "--tasks", "4", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)["epsilon"]
    assert evaluated == pytest.approx(implemented, abs=1e-9, rel=0)
    _every_field_is_in_the_released_fields_table(summary)
    registry, collector = exporter_registry(tmp_path / "l.sqlite", [tmp_path / "runs"],
                                            affordable=False)  # fmt: skip
    try:
        text = generate_latest(registry).decode()
    finally:
        collector.close()
    m = re.search(r"^fedmeta_last_run_epsilon_spent_task\{[^}]*\} (\S+)$", text, re.M)
    assert m is not None and float(m.group(1)) == pytest.approx(implemented, abs=1e-9, rel=0)
    stamp = re.search(r"^fedmeta_last_run_timestamp_seconds\{[^}]*\} (\S+)$", text, re.M)
    assert stamp is not None and float(stamp.group(1)) % 86400 == 0  # a day, no finer
    lock = json.loads((out / LOCK_NAME).read_text())
    assert set(lock) == {"pid", "host", "started_day", "command"}
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", lock["started_day"])


@pytest.mark.integration
def test_a_failing_participant_is_named_in_the_operator_log_only(
    tmp_path: Path, isolated_state_dir: Path
) -> None:
    from fedmeta import protocol as P
    from fedmeta.client.app import app as client_app
    from fedmeta.config_io import load_config
    from fedmeta.server.app import execute
    from fedmeta.server.operator_log import operator_log_path
    from fedmeta.simulation.local_grid import InProcessGrid

    def broken_first(msg: object, ctx: object) -> object:
        if (
            msg.metadata.message_type == P.MSG_TRAIN  # type: ignore[attr-defined]
            and ctx.node_config[P.NODE_PARTITION_ID] == 0
        ):  # type: ignore[attr-defined]
            raise RuntimeError("the ClientApp of participant zero is broken")
        return client_app(msg, ctx)  # type: ignore[arg-type]

    cfg = load_config(None, [*SMALL, "rounds=4", "sampling.participants_per_round=6",
                             f"privacy.ledger_path={tmp_path / 'l.sqlite'}"])  # fmt: skip
    out = tmp_path / "out"
    result = execute(cfg, InProcessGrid(6, broken_first), out_dir=out, observers=[], echo=False)
    log = operator_log_path(result.summary["run_id"])
    assert log.is_relative_to(isolated_state_dir) and not log.is_relative_to(out)
    text = log.read_text()
    assert "participant 0: error_reply" in text and "participant zero is broken" in text, text
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    released = " ".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()
                        and p.suffix in (".json", ".csv", ".txt", ".jsonl", ""))  # fmt: skip
    assert "participant zero" not in released and "participant 0:" not in released


def _every_field_is_in_the_released_fields_table(summary: dict[str, object]) -> None:
    """docs/privacy.md's table of released fields names every top-level field of summary.json."""
    docs = Path(__file__).resolve().parents[2] / "docs" / "privacy.md"
    rows = [line for line in docs.read_text().splitlines() if line.startswith("| `summary.json`")]
    named = set(re.findall(r"`([a-z0-9_]+)`", " ".join(row.split("|")[2] for row in rows)))
    assert not set(summary) - named, f"fields missing from the table: {set(summary) - named}"
