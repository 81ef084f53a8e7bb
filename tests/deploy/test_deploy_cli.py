"""fedmeta deploy run / participant without a SuperLink: the configuration sent with a run, the exit
status of each outcome, the code-free app, the participant's commands."""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

import pytest

from fedmeta import exitcodes
from fedmeta.cli import deploy_participant, deploy_run, deploy_run_config
from fedmeta.cli.deploy_flwr import DeployError
from fedmeta.config_io import load_config

pytestmark = [pytest.mark.deploy, pytest.mark.unit]

CONFIG = """
rounds = 7
seed = 3
[privacy]
epsilon_budget = 2.5
noise_multiplier = 1.1
ledger_path = "/srv/ledger; or not.sqlite"
[federation]
participants = 4
[sampling]
participants_per_round = 2
task_rate = 0.25
[dataset]
name = "sinusoid"
path = "/data/caf\u00e9 \\"x\\""
"""


def _args(tmp_path: Path, text: str = CONFIG, **kw: object) -> argparse.Namespace:
    path = tmp_path / "fed.toml"
    path.write_text(text)
    values: dict[str, object] = {"config": path, "overrides": [], "node_keys": None, **kw}
    return argparse.Namespace(**values)


def test_the_config_travels_as_overrides_and_rebuilds_the_same_tree(tmp_path: Path) -> None:
    text = CONFIG.replace("/srv/ledger; or not.sqlite", "/srv/ledger.sqlite")
    args = _args(tmp_path, text, overrides=["rounds=9", "training.meta_lr=0.02"])
    sets, cfg = deploy_run_config.run_overrides(args)
    assert cfg == load_config(args.config, args.overrides)
    assert cfg.rounds == 9 and cfg.dataset.path == '/data/caf\u00e9 "x"'
    # What the ServerApp reads: the run config's `set`, split on ';'.
    run_toml = deploy_run_config.run_config_file(tmp_path / "run.toml", sets, "/runs/a", False)
    loaded = tomllib.loads(run_toml.read_text())
    assert loaded["set"].split(";") == sets and loaded["out"] == "/runs/a"


def test_a_value_with_a_semicolon_or_a_bad_key_is_refused_here(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="';'") as semicolon:
        deploy_run_config.run_overrides(_args(tmp_path))
    assert semicolon.value.status == exitcodes.BAD_INPUT
    with pytest.raises(DeployError, match="federation.bogus") as bad:
        deploy_run_config.run_overrides(_args(tmp_path, "[federation]\nbogus = 1\n"))
    assert bad.value.status == exitcodes.BAD_INPUT
    # A TOML date is refused by validation, before it is written as an override.
    with pytest.raises(DeployError, match="privacy.delta must be a number") as date:
        deploy_run_config.run_overrides(_args(tmp_path, "[privacy]\ndelta = 1979-05-27\n"))
    assert date.value.status == exitcodes.BAD_INPUT


def test_node_keys_file_becomes_one_override(tmp_path: Path) -> None:
    keys = tmp_path / "node-keys.toml"
    keys.write_text('[federation.node_keys]\n"0" = "SHA256:abc+/x"\n"7" = "SHA256:def"\n')
    line = deploy_run_config.node_keys_override(keys)
    assert line.startswith("federation.node_keys=")
    value = tomllib.loads("v = " + line.split("=", 1)[1])["v"]
    assert value == {"0": "SHA256:abc+/x", "7": "SHA256:def"}
    keys.write_text("[other]\n")
    with pytest.raises(DeployError, match="make-certs.sh writes one"):
        deploy_run_config.node_keys_override(keys)


@pytest.mark.parametrize(
    ("status", "stopped", "rounds", "error", "code"),
    [
        ("finished:completed", "budget_exhausted", 12, "", exitcodes.OK),
        ("finished:completed", "planned_rounds", 5, "", exitcodes.OK),
        ("finished:completed", "budget_exhausted", 0, "", exitcodes.BUDGET_EXHAUSTED),
        ("finished:completed", "interrupted", 3, "", exitcodes.INTERRUPTED),
        ("finished:stopped", None, None, "", exitcodes.INTERRUPTED),
        ("timeout", None, None, "", exitcodes.INTERRUPTED),
        ("finished:failed", None, None, "RegistrationError", exitcodes.UNAVAILABLE),
        ("finished:failed", None, None, "RunDirectoryBusy", exitcodes.UNAVAILABLE),
        ("finished:failed", None, None, "ConfigError", exitcodes.BAD_INPUT),
        ("finished:failed", None, None, "LedgerError", exitcodes.BAD_INPUT),
        ("finished:failed", None, None, "PlanError", exitcodes.BAD_INPUT),
        ("finished:failed", None, None, "ZeroDivisionError", exitcodes.INTERNAL_ERROR),
        ("finished:failed", None, None, "", exitcodes.INTERNAL_ERROR),
    ],
)
def test_exit_status_follows_fedmeta_exit_codes(
    status: str, stopped: str | None, rounds: int | None, error: str, code: int
) -> None:
    outcome = deploy_run.Outcome("1", status, "details", stopped, rounds, "/runs/x", error=error)
    assert deploy_run.exit_status(outcome) == code


def test_outcome_and_exception_class_read_from_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = (
        "Traceback (most recent call last):\n  File ...\n"
        "fedmeta.server.transport.RegistrationError: 2 participants registered; needs >= 5\n"
        "ERROR: Exit Code: 201\n"
    )
    reply = argparse.Namespace(stdout=log, returncode=0)
    monkeypatch.setattr(deploy_run, "flwr", lambda *a, **k: reply)
    details = "ServerApp failed with exception: 2 participants registered; needs >= 5"
    outcome = deploy_run.read_outcome({}, "9", "finished:failed", details, str(tmp_path / "none"))
    assert outcome.error == "RegistrationError"
    assert deploy_run.exit_status(outcome) == exitcodes.UNAVAILABLE
    # A completed run: summary.json where this host sees it, else the printed summary.
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps(
        {"stopped_reason": "budget_exhausted", "rounds_completed": 0,
         "ledger": {"path": "/ledger/ledger.sqlite", "records": 4}}))  # fmt: skip
    done = deploy_run.read_outcome({}, "9", "finished:completed", "", str(out))
    assert (done.rounds_completed, done.ledger) == (0, "/ledger/ledger.sqlite")
    assert deploy_run.exit_status(done) == exitcodes.BUDGET_EXHAUSTED
    printed = (
        "rounds completed 14 of 1000 planned | stopped: budget_exhausted\noutputs: /r/summary.json"
    )
    reply = argparse.Namespace(stdout=printed, returncode=0)
    monkeypatch.setattr(deploy_run, "flwr", lambda *a, **k: reply)
    remote = deploy_run.read_outcome({}, "9", "finished:completed", "", "/elsewhere")
    assert (remote.rounds_completed, remote.stopped_reason, remote.out) == (
        14, "budget_exhausted", "/r",
    )  # fmt: skip


def test_every_run_gets_its_own_output_directory() -> None:
    outs = {deploy_run_config.default_out("/runs/") for _ in range(50)}
    assert len(outs) == 50 and all(o.startswith("/runs/run-") for o in outs)


def test_the_app_has_no_code_and_this_fedmeta_version(tmp_path: Path) -> None:
    from importlib import metadata

    app = deploy_run_config.write_app(tmp_path / "app")
    assert [p.name for p in app.iterdir()] == ["pyproject.toml"]
    project = tomllib.loads((app / "pyproject.toml").read_text())
    assert project["project"]["name"] == "fedmeta"
    assert project["project"]["version"] == metadata.version("fedmeta")
    assert project["tool"]["flwr"]["app"]["components"] == {
        "serverapp": "fedmeta.server.app:app", "clientapp": "fedmeta.client.app:app"}  # fmt: skip


def _participant(tmp_path: Path, **kw: object) -> argparse.Namespace:
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    values: dict[str, object] = dict(
        superlink="fl.example.org:443", root_certificates=ca, insecure=False, participant_id="3",
        node_key=None, data_path=str(tmp_path / "data"), runtime_port=9094, warm_config=None,
        alive_file=None, task_timeout=600.0, poll=0.1, stock_poll=False, timings=None, extra=[],
    )  # fmt: skip
    values.update(kw)
    return argparse.Namespace(**values)


def test_participant_runs_a_fast_supernode_and_a_worker_on_loopback(tmp_path: Path) -> None:
    key = tmp_path / "node.key"
    key.write_text("k")
    node, worker = deploy_participant.participant_commands(_participant(tmp_path, node_key=key))
    assert node[1:3] == ["-m", "fedmeta.client.supernode"]
    assert node[node.index("--superlink") + 1] == "fl.example.org:443"
    assert "--insecure" not in node and node[node.index("--isolation") + 1] == "process"
    assert node[node.index("--host") + 1] == "127.0.0.1"  # the Runtime API stays on the node
    assert node[node.index("--auth-supernode-private-key") + 1] == str(key.resolve())
    config = node[node.index("--node-config") + 1]
    assert config == f'participant-id="3" data-path="{(tmp_path / "data").resolve()}"'
    assert worker[1:3] == ["-m", "fedmeta.client.worker"]
    assert worker[worker.index("--runtime-api-address") + 1] == "127.0.0.1:9094"
    assert worker[worker.index("--node-config") + 1] == config


def test_participant_refuses_what_it_cannot_run_safely(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="--root-certificates CA"):
        deploy_participant.participant_commands(_participant(tmp_path, root_certificates=None))
    with pytest.raises(DeployError, match="not both"):
        deploy_participant.participant_commands(_participant(tmp_path, insecure=True))
    with pytest.raises(DeployError, match="--participant-id"):
        deploy_participant.participant_commands(_participant(tmp_path, participant_id=None))
    with pytest.raises(DeployError, match="without quotes"):
        deploy_participant.participant_commands(_participant(tmp_path, participant_id='3" evil="1'))
    insecure = _participant(tmp_path, root_certificates=None, insecure=True)
    node, _ = deploy_participant.participant_commands(insecure)
    assert "--insecure" in node


@pytest.mark.parametrize(
    ("error", "status", "hint"),
    [
        ("NoRoundAffordable", exitcodes.BUDGET_EXHAUSTED, None),
        ("ConfigError", exitcodes.BAD_INPUT, None),
        ("", exitcodes.INTERNAL_ERROR, "continue with: fedmeta deploy run --resume --out /runs/x"),
    ],
)
def test_a_failed_run_names_the_resume_command_only_where_there_is_a_run_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], error: str, status: int, hint: str | None
) -> None:
    """The third compose run, whose budget affords no round (exit 3), was told to resume."""
    outcome = deploy_run.Outcome(
        "5", "finished:failed", f"{error}: no", None, None, "/runs/x", error=error
    )
    assert deploy_run.exit_status(outcome) == status
    args = argparse.Namespace(superlink="superlink:8000", insecure=True, root_certificates=None,
                              config=None, node_keys=None, overrides=[])  # fmt: skip
    deploy_run.report(outcome, status, args)
    err = capsys.readouterr().err
    assert "continue with" not in err if hint is None else hint in err, err
    assert f"(exit status {status})" in err


def test_submit_tries_an_unreachable_superlink_again_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after `docker compose up` the SuperLink was unreachable from the serverapp container
    for a moment (a fresh podman): the first run of the compose test failed on it. Only a fast
    failure is tried again: flwr words a read timeout the same, and that request may have
    created the run."""
    unreachable = (
        '{"success": false, "error-message": "Connection to the SuperLink is unavailable."}'
    )
    replies: list[tuple[str, float]] = []  # (flwr's output, seconds the call took)
    calls: list[tuple[str, ...]] = []
    clock = [0.0]

    def fake_flwr(env: object, *args: str, timeout: float = 0) -> argparse.Namespace:
        calls.append(args)
        out, took = replies.pop(0)
        clock[0] += took
        return argparse.Namespace(stdout=out, stderr="", returncode=1)

    monkeypatch.setattr(deploy_run, "flwr", fake_flwr)
    monkeypatch.setattr(deploy_run.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(deploy_run.time, "monotonic", lambda: clock[0])
    replies[:] = [(unreachable, 0.1), (unreachable, 0.1), ('{"success": true, "run-id": 77}', 1)]
    assert deploy_run.submit({}, tmp_path, tmp_path / "run.toml") == "77" and len(calls) == 3
    # Final at once: another refusal, a slow failure (the request may have been received), and
    # a fast one once reach_s has passed.
    for reply, took, reach_s in (('{"error-message": "Invalid run config"}', 0.1, 60.0),
                                 (unreachable, 30.0, 60.0), (unreachable, 0.1, 0.0)):  # fmt: skip
        replies[:] = [(reply, took)]
        calls.clear()
        with pytest.raises(DeployError) as caught:
            deploy_run.submit({}, tmp_path, tmp_path / "run.toml", reach_s=reach_s)
        assert caught.value.status == exitcodes.UNAVAILABLE and len(calls) == 1


def _worker_args(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], *argv: str
) -> argparse.Namespace:
    """``fedmeta deploy worker ARGV`` as the CLI parses it, with ``env`` as the environment."""
    from fedmeta.cli import build_parser

    for key in ("FEDMETA_RUNTIME_API", "FEDMETA_PARTICIPANT_ID", "FEDMETA_DATA_PATH",
                "FEDMETA_RUNTIME_CA", "FEDMETA_SUPEREXEC_SECRET", "FEDMETA_WORKER_ALIVE",
                "FEDMETA_WARM_CONFIG"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return build_parser().parse_args(["deploy", "worker", *argv])


def test_worker_alone_reaches_a_supernode_elsewhere_with_the_participants_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The compose overlay for Flower's images starts `fedmeta deploy worker` from the participant
    image's environment: the worker reaches the SuperNode on the loopback they share, with the
    same node config as the SuperNode, and touches the liveness file its healthcheck reads."""
    env = {"FEDMETA_PARTICIPANT_ID": "0", "FEDMETA_DATA_PATH": "/data",
           "FEDMETA_WORKER_ALIVE": "/tmp/alive"}  # fmt: skip
    args = _worker_args(monkeypatch, env)
    assert args.func is deploy_participant._handle_worker
    command = deploy_participant.worker_only_command(args)
    assert command[1:3] == ["-m", "fedmeta.client.worker"]
    assert command[command.index("--runtime-api-address") + 1] == "127.0.0.1:9094"
    # What deploy/compose/flower-images.yml gives the SuperNode as its --node-config.
    assert command[command.index("--node-config") + 1] == 'participant-id="0" data-path="/data"'
    assert command[command.index("--alive-file") + 1] == "/tmp/alive"
    assert "--root-certificates" not in command and "--superexec-auth-secret-file" not in command
    ca, secret = tmp_path / "ca.crt", tmp_path / "secret"
    args = _worker_args(monkeypatch, {}, "--participant-id", "7", "--runtime-api-address",
                        "10.0.0.5:9094", "--runtime-ca", str(ca), "--superexec-auth-secret-file",
                        str(secret))  # fmt: skip
    command = deploy_participant.worker_only_command(args)
    assert command[command.index("--root-certificates") + 1] == str(ca)
    assert command[command.index("--superexec-auth-secret-file") + 1] == str(secret)
    assert command[command.index("--node-config") + 1] == 'participant-id="7"'


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "--participant-id"),
        (("--participant-id", "1", "--runtime-api-address", "supernode-0"), "give host:port"),
        (("--participant-id", "1", "--runtime-api-address", ":9094"), "give host:port"),
        (("--participant-id", '1" x="2'), "without quotes"),
    ],
)
def test_worker_refuses_bad_settings_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
    message: str,
) -> None:
    args = _worker_args(monkeypatch, {}, *argv)
    assert args.func(args) == exitcodes.BAD_INPUT  # before anything is started
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedmeta deploy worker: ") and message in err[0]


class _Exec(Exception):
    pass


@pytest.mark.parametrize(
    ("address", "warned"), [("127.0.0.1:9094", False), ("10.0.0.5:9094", True)]
)
def test_worker_warns_of_plain_http_beyond_the_loopback_then_becomes_the_worker(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], address: str,
    warned: bool,
) -> None:
    execs: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        execs.append(argv)
        raise _Exec

    monkeypatch.setattr(deploy_participant.os, "execv", execv)
    args = _worker_args(monkeypatch, {"FEDMETA_PARTICIPANT_ID": "2"},
                        "--runtime-api-address", address)  # fmt: skip
    with pytest.raises(_Exec):
        args.func(args)
    (argv,) = execs
    assert argv == deploy_participant.worker_only_command(args)
    err = capsys.readouterr().err
    assert "--node-config must be 'participant-id=\"2\"'" in err
    assert ("plain HTTP to the Runtime API" in err) is warned
