"""The accounting comparisons under restricted instruction sets, so CPU differences show up here.

numpy dispatches exp, log, arctan2 and sums to the best instruction set it finds (on x86-64:
the X86_V2 baseline, X86_V3 = AVX2/FMA3, X86_V4 and later = AVX-512); each rounds differently, which
is how a comparison that passed on one machine failed on an AVX2-only AMD EPYC (issue 21).
``NPY_DISABLE_CPU_FEATURES`` turns dispatch targets off in a fresh interpreter, so the suite runs
the comparisons on the baseline and on the AVX2 path whatever CPU it runs on (an AVX-512 path can
only be exercised on a CPU that has it, where the plain run covers it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: Dispatch targets to turn off; numpy ignores a name the CPU lacks and refuses a baseline one.
VARIANTS = {
    "baseline": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR",
    "no-avx512": "X86_V4 AVX512_ICL AVX512_SPR",
}
#: The comparisons with another library or an oracle, where rounding could decide the outcome.
COMPARISONS = [
    "tests/accounting/test_accounting_bounded.py::" + name
    for name in (
        "test_pmfs_and_their_queries_match_dp_accounting",
        "test_self_composition_is_never_below_the_exact_one",
        "test_vectorised_deltas_match_dp_accounting",
        "test_connect_the_dots_is_dp_accountings_bit_for_bit",
        "test_pld_delta_is_the_smaller_valid_bound",
        "test_a_coarser_grid_is_never_below_a_finer_one",
    )
]


def _env(disabled: str) -> dict[str, str]:
    env = dict(os.environ)
    env["NPY_DISABLE_CPU_FEATURES"] = disabled
    return env


@pytest.mark.integration
def test_the_variable_restricts_numpys_dispatch() -> None:
    # Otherwise the runs below would silently repeat the plain one.
    features = "np._core._multiarray_umath.__cpu_features__"
    code = f"import json, numpy as np; print(json.dumps({features}))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(VARIANTS["baseline"]),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    features = json.loads(out.stdout)
    assert features.get("X86_V3") is False and features.get("X86_V4") is False, features


def _run_pytest(disabled: str, targets: list[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    return subprocess.run(
        command + targets,
        cwd=REPO,
        env=_env(disabled),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


@pytest.mark.integration
def test_accounting_comparisons_hold_on_the_baseline_instruction_set() -> None:
    # The default run: the path furthest from any machine's own (no AVX2, no AVX-512).
    result = _run_pytest(VARIANTS["baseline"], COMPARISONS)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_accounting_test_holds_with_cpu_features_off(variant: str) -> None:
    # Every accounting test file (the default selection of each), also the reference tables.
    targets = [str(p.relative_to(REPO)) for p in sorted(HERE.glob("test_accounting_*.py"))]
    targets.remove(str(Path(__file__).relative_to(REPO)))
    result = _run_pytest(VARIANTS[variant], targets)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
