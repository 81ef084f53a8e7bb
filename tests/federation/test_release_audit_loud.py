"""The release-path audit's two checks at delta 1e-2 (the substitution, the noise halved), at the
trial count its power analysis fixed (tests/federation/test_release_audit.py, its docstring): a
file of their own, so that the default suite's two workers, which take tests by file, run them
beside the rest of the audit."""

from __future__ import annotations

import pytest

from .test_release_audit import check_loud


@pytest.mark.integration
def test_release_path_audit_catches_the_controls_at_delta_1e_2() -> None:
    check_loud(subtle=6_000)
