"""Configuration in and out: TOML and ``--set`` overrides read into the tree, errors as one line.

The schema (the pydantic tree and its validators) is :mod:`fedmeta.config`; this module is its edge.
``load_config`` reads a TOML file, applies ``--set key=value`` overrides (each value parsed for its
field's type), validates once, and turns pydantic's errors into one line naming every bad field and
its fix (``invalid configuration: privacy.delta must be > 0 and < 1; got 2``); ``to_toml`` writes
a tree back as a file (``simulate --print-config``, ``privacy plan --write-config``).
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from fedmeta.config import Config, ConfigError, dotted_keys

# --------------------------------------------------------------------------------------------------
# ``--set key=value`` overrides


def _parse_value(text: str) -> Any:
    """Parse a ``--set`` value as TOML (numbers, booleans, strings, arrays), else a bare string."""
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _field_at(parts: Sequence[str]) -> FieldInfo | None:
    """The declared field at a dotted path, or None where the path names no field."""
    model: Any = Config
    info = None
    for part in parts:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        info = fields[part]
        model = info.annotation
    return info


def _is_text(info: FieldInfo | None) -> bool:
    """Whether a field holds text only (str, a Literal of strings, either of them or None)."""
    if info is None:
        return False
    annotation = info.annotation
    kinds = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    options = [k for k in kinds if k is not type(None)]
    return bool(options) and all(
        k is str or (get_origin(k) is Literal and all(isinstance(a, str) for a in get_args(k)))
        for k in options
    )


def _override_value(parts: Sequence[str], raw: str) -> Any:
    """A ``--set`` value parsed for its field's type, then validated strictly with the tree.

    A text field keeps the text as written (``--set dataset.path=2024`` is the folder "2024", not
    a number); TOML quotes around it are dropped. Every other field reads the value as TOML, so
    ``--set rounds=true`` arrives as a boolean and strict validation refuses it.
    """
    if not _is_text(_field_at(parts)):
        return _parse_value(raw)
    if raw.lower() in ("none", "null"):
        return None
    parsed = _parse_value(raw)
    return parsed if isinstance(parsed, str) else raw


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with ``key.sub=value`` overrides applied."""
    # A deep copy, not a JSON round trip: a TOML date is no JSON, and validation names its field.
    out: dict[str, Any] = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value; got {item!r}")
        key, _, raw = item.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"--set expects key=value; got {item!r}")
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{'.'.join(parts)}: {p} is not a section")
            node = nxt
        node[parts[-1]] = _override_value(parts, raw.strip())
    return out


# --------------------------------------------------------------------------------------------------
# pydantic's errors as one line naming each field and its fix


def _field_bounds(loc: Sequence[Any]) -> list[str]:
    """The declared numeric bounds of the field at ``loc`` (e.g. ``['> 0', '< 1']``)."""
    info = _field_at([str(part) for part in loc])
    out = []
    for meta in getattr(info, "metadata", []) or []:
        for k, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(meta, k, None)
            if v is not None:
                out.append(f"{sym} {v}")
    return out


#: Strict type errors, with the fix: a TOML value of the field's type, as the user would write it.
_TYPE_FIXES = {
    "int_type": "must be an integer: write it without quotes or a decimal point (e.g. 200); "
    "true/false are not numbers",
    "float_type": "must be a number: write it without quotes (e.g. 8 or 1e-5); true/false are not "
    "numbers",
    "bool_type": "must be true or false (TOML booleans, without quotes)",
    "string_type": "must be text: in a TOML file write it in quotes",
    "dict_type": 'must be a table of text values (e.g. { name = "key" })',
}


def _did_you_mean(key: str) -> str:
    """``; did you mean privacy.epsilon_budget?`` for a mistyped or misplaced key ('' if none)."""
    import difflib

    keys = dotted_keys()
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    if not close:  # the right name in the wrong section (``epsilon_budget`` for privacy.*)
        leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
        leaf = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.8)
        close = [leaves[leaf[0]]] if leaf else []
    return f"; did you mean {close[0]}?" if close else ""


def _section_hint(loc: str, got: Any) -> str | None:
    """The fix for a value given where a section is (``privacy.adaptive_clipping=false``)."""
    sections = {k.rsplit(".", 1)[0] for k in dotted_keys() if "." in k}
    if loc not in sections or isinstance(got, dict):
        return None
    example = f"{loc}.enabled={str(got).lower()}" if f"{loc}.enabled" in dotted_keys() else None
    keys = [k for k in dotted_keys() if k.startswith(loc + ".")]
    fix = f"--set {example}" if example else f"one of its keys ({', '.join(keys[:4])}, ...)"
    return f"{loc} is a section, not a value; set {fix}"


def _format_error(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"]
        ctx = e.get("ctx") or {}
        bounds = []
        for k, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if k in ctx:
                bounds.append(f"{sym} {ctx[k]}")
        section = _section_hint(loc, e.get("input")) if e["type"] in _NOT_A_SECTION else None
        if section is not None:
            lines.append(section)
            continue
        if e["type"] == "extra_forbidden":
            msg = f"unknown key{_did_you_mean(loc)} (docs/federation.md lists the keys)"
        elif e["type"] in _TYPE_FIXES:
            msg = _TYPE_FIXES[e["type"]]
        elif e["type"] == "literal_error" and "expected" in ctx:
            msg = f"must be one of {ctx['expected']}"
        elif bounds:
            msg = "must be " + " and ".join(_field_bounds(e["loc"]) or bounds)
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        got = e.get("input")
        got_s = "" if isinstance(got, dict) else f"; got {got!r}"
        # A section's own check names the full dotted field already.
        prefix = f"{loc} " if loc and not msg.startswith(f"{loc}.") else ""
        lines.append(f"{prefix}{msg}{got_s}")
    return "invalid configuration: " + "; ".join(lines)


#: pydantic's error types for a scalar given where a section (a nested model) belongs.
_NOT_A_SECTION = ("model_type", "model_attributes_type", "dict_type")


# --------------------------------------------------------------------------------------------------
# writing (``simulate --print-config``, ``privacy plan --write-config``)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def toml_value(value: Any) -> str:
    """``value`` as a TOML inline value: a boolean, number, string, array or inline table.

    Read back as TOML (a file's ``key = VALUE``, or ``--set key=VALUE``), it is ``value`` again.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML basic-string escapes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        pairs = (f"{_toml_key(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    raise TypeError(
        "a configuration value must be a TOML boolean, number, string, array or table; "
        f"got {value!r}"
    )


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """TOML text for nested dicts of scalars and arrays (what a configuration holds)."""
    lines = [f"{_toml_key(k)} = {toml_value(v)}" for k, v in data.items()
             if not isinstance(v, dict) and v is not None]  # fmt: skip
    for key, table in data.items():
        if isinstance(table, dict):
            name = f"{prefix}{_toml_key(key)}"
            lines += ["", f"[{name}]", to_toml(table, name + ".").strip("\n")]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# loading


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Validate a plain dict into a :class:`Config` (raises :class:`ConfigError`)."""
    try:
        return Config.model_validate(dict(data))
    except ValidationError as error:
        raise ConfigError(_format_error(error)) from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML file (optional), apply ``--set`` overrides, validate once."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ConfigError(
                f"{p}: not UTF-8 text ({error.reason} at byte {error.start})"
            ) from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{p}: not valid TOML: {error}") from None
        except OSError as error:
            raise ConfigError(f"{p}: cannot be read ({error.strerror})") from None
    return config_from_dict(apply_overrides(data, overrides))
