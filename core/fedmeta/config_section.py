"""The base of every section of fedmeta's configuration tree (``fedmeta.config.Config``).

Its own module so that each group of sections (``config_privacy``, ``config_federation``,
``config_training``, and the tree's root in ``config``) can share it without importing the root.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A section of the tree: unknown keys refused, frozen, defaults validated, no coercion."""

    # strict: no bool read as a number, no string read as a number (a TOML `rounds = true` or
    # `epsilon_budget = "8"` is refused, not run); an integer is a valid float.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)
