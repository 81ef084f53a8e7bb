"""The ``fedmeta`` command line: the entry layer on top of server, client and simulation.

Each sub-command lives next to the code it drives and exposes ``register(subparsers)``; only the
command a command line names is imported and registered (commands.py), the others are listed by
name and help alone. So ``fedmeta --version`` and ``--help`` import no command, and ``fedmeta
ledger show`` not the planner, Flower or torch (tests/test_startup.py checks the imports;
bench/cli_latency.py measures the time).

The conventions every command shares live here, once: ``--version``; a usage error is one line
(with a did-you-mean for a mistyped command or flag) and exit status 2; Ctrl-C is one line and exit
status 130, never a traceback; a closed pipe (``fedmeta ledger show --json | head``) ends the
command quietly with status 0, as for ``cat``'s readers.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from fedmeta import exitcodes
from fedmeta.pipes import ReaderMayLeave, to_devnull


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedmeta")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``, on stdout as argparse's own, but the version looked up only when asked.

    importlib.metadata reads installed distributions' metadata: a cost no other command should pay.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show program's version number and exit")  # fmt: skip

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        print(f"fedmeta {_version()}")
        parser.exit()


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line with a did-you-mean, then exit status 2.

    argparse prints the whole usage before the error, which buries the one line that matters; the
    usage stays one ``--help`` away. Sub-parsers inherit the class (argparse creates them with the
    parent's class).
    """

    def error(self, message: str) -> NoReturn:  # noqa: D102
        hint = _did_you_mean(self, message)
        line = f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n"
        self.exit(exitcodes.BAD_INPUT, line)


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """``; did you mean 'simulate'?`` for an invalid choice or an unrecognised flag."""
    choice = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        word, options = choice.group(1), re.findall(r"'([^']*)'", choice.group(2))
    else:
        flag = re.match(r"unrecognized arguments: (--?[\w.-]+)(?:[= ](\S+))?", message)
        if not flag:
            return ""
        key = _config_key(parser, flag.group(1))
        if key is not None:  # `simulate --rounds 20`: a configuration key, set with --set
            return f"; use --set {key}={flag.group(2) or 'VALUE'}"
        word, options = flag.group(1), _flags(parser)
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _config_key(parser: argparse.ArgumentParser, flag: str) -> str | None:
    """The configuration key ``flag`` names (``--rounds``), where the command takes ``--set``."""
    if "--set" not in _flags(parser):
        return None
    from fedmeta.config import dotted_keys

    name = flag.lstrip("-").replace("-", "_")
    keys = dotted_keys()
    if name in keys:
        return name
    leaves = [k for k in keys if k.rsplit(".", 1)[-1] == name]
    return leaves[0] if len(leaves) == 1 else None


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace
                    ) -> argparse.ArgumentParser:  # fmt: skip
    """The (sub-)parser of the command ``args`` parsed: its name and flags go in an error."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest or "", None) or "")
            return parser if chosen is None else _command_parser(chosen, args)
    return parser


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every visible flag of ``parser`` and its sub-commands.

    argparse reports an unknown flag from the top-level parser, which does not know which
    sub-command it was meant for.
    """
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _flags(sub)
        elif action.help != argparse.SUPPRESS:
            out += [s for s in action.option_strings if s.startswith("--")]
    return out


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser, every command registered; with ``argv``, only the one it names.

    The others are there by name and help alone: enough for ``--help`` and a did-you-mean.
    """
    parser = OneLineParser(
        prog="fedmeta",
        description="Differentially private federated meta-learning.",
    )
    parser.add_argument("--version", action=_VersionAction)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    # Imported here, not at the top, so that a Ctrl-C while a command's modules load (torch takes
    # seconds) meets main's handler.
    from fedmeta.cli.commands import COMMANDS, named_in

    chosen = None if argv is None else named_in(argv)
    for command in COMMANDS:
        if argv is None or command.name == chosen:
            command.register(subparsers)
        else:
            subparsers.add_parser(command.name, help=command.help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit status.

    A reader that leaves (``fedmeta simulate | head``, ``deploy run | head``) never ends a command
    half way: a run, a tuning or a deployed run goes on with its output dropped
    (:class:`ReaderMayLeave`), since stopping it between spends would waste budget already paid.
    """
    stdout, sys.stdout = sys.stdout, ReaderMayLeave.around(sys.stdout)
    try:
        return _run(argv)
    finally:
        sys.stdout = stdout


def _run(argv: Sequence[str] | None) -> int:
    try:
        words = list(sys.argv[1:] if argv is None else argv)
        parser = build_parser(words)
        args, extra = parser.parse_known_args(words)
        if extra:  # reported by the command it was given to, with its flags (and --set)
            _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        result: Any = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
    except KeyboardInterrupt:
        print(f"\n{_command(argv)}: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED
    except BrokenPipeError:
        # The reader has what it wanted (`| head`): nothing more to say, and nothing failed.
        to_devnull(sys.stdout)  # the interpreter's final flush into the closed pipe is silent
        return 0
    return int(result or 0)


def _command(argv: Sequence[str] | None) -> str:
    words = list(sys.argv[1:] if argv is None else argv)
    names = [w for w in words[:2] if not w.startswith("-")]
    return " ".join(["fedmeta", *names[:2]])
