"""Bounded memory: a round that cannot fit is refused up front with the number it would need.

Issue 21: 100,000 participants with 10 million tasks each grew to 24 GB and was killed by the
kernel. The estimate (core/fedmeta/capacity.py) is checked here against its parts, and end to end in
a
subprocess whose address space is capped (RLIMIT_AS): the huge configuration is refused in one
line, a small one runs to the end inside the same cap.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedmeta.accounting import randomness
from fedmeta.accounting.randomness import InsecureSeededSource, bernoulli
from fedmeta.capacity import MARGIN_BYTES, check_round_fits, round_memory
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config

REPO = Path(__file__).resolve().parents[2]
HUGE = ["federation.participants=100000", "dataset.tasks_per_participant=10000000", "rounds=1"]


@pytest.mark.unit
def test_the_estimate_grows_with_what_one_round_sends() -> None:
    cfg = load_config(None, ["federation.participants=10", "sampling.task_rate=0.5",
                             "dataset.tasks_per_participant=100"])  # fmt: skip
    need = round_memory(cfg, dim=1000)
    assert need.expected_tasks == 10 * 100 * 0.5
    assert need.replies >= 500 * 1000 * 4  # one float32 gradient per task (per_task replies)
    summed = round_memory(load_config(None, [*HUGE, "federation.reply_format=sum_and_norms"]), 1000)
    assert summed.replies < round_memory(load_config(None, HUGE), 1000).replies / 100
    assert need.total == MARGIN_BYTES + need.requests + need.task_ids + need.replies + 100


@pytest.mark.unit
def test_the_huge_configuration_is_refused_with_the_number_it_needs() -> None:
    with pytest.raises(ConfigError) as caught:
        check_round_fits(load_config(None, HUGE), dim=1000, available=2e9)
    text = str(caught.value)
    assert "one round would need about" in text and "5e+10 tasks expected" in text
    assert "sampling.participants_per_round" in text and "\n" not in text
    check_round_fits(load_config(None, ["rounds=1"]), dim=1000, available=2e9)  # the default fits


@pytest.mark.unit
def test_a_large_bernoulli_draw_streams_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(randomness, "BERNOULLI_CHUNK", 1000)
    sizes: list[int] = []
    source = InsecureSeededSource(1)
    real = source.random_bytes

    def random_bytes(n: int) -> bytes:
        sizes.append(n)
        return real(n)

    monkeypatch.setattr(source, "random_bytes", random_bytes)
    flags = bernoulli(source, 10_500, 0.3)
    assert flags.shape == (10_500,) and max(sizes) == 8 * 1000 and sum(sizes) == 8 * 10_500
    # Each chunk is the same exact comparison: a 5-sigma band around 0.3.
    assert abs(flags.mean() - 0.3) < 5 * np.sqrt(0.3 * 0.7 / 10_500)


_CHILD = """
import resource, sys
from pathlib import Path
from fedmeta.config import ConfigError
from fedmeta.config_io import load_config
from fedmeta.simulation.simulate import main
from fedmeta.capacity import _virtual_size
import torch, fedmeta.server.app, fedmeta.client.app, fedmeta.metalearning  # before the cap

cap = int(_virtual_size() + float(sys.argv[2]) * 1e9)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
try:
    result = main(load_config(None, sys.argv[3:]), out_dir=Path(sys.argv[1]))
except ConfigError as error:
    print(f"refused: {error}")
    sys.exit(2)
print("completed", result.summary["rounds_completed"])
"""


def _capped(
    out: Path, headroom_gb: float, sets: list[str], tmp: Path
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FEDMETA_STATE_DIR": str(tmp / "state"), "MALLOC_ARENA_MAX": "2",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    command = [sys.executable, "-c", _CHILD, str(out), str(headroom_gb), *sets]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.integration
def test_under_a_memory_cap_the_huge_configuration_is_refused_at_once(tmp_path: Path) -> None:
    sets = [*HUGE, "federation.backend=inprocess"]
    result = _capped(tmp_path / "out", 1.0, sets, tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert "one round would need about" in result.stdout and not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_under_the_same_cap_a_small_run_completes(tmp_path: Path) -> None:
    sets = ["federation.backend=inprocess", "rounds=2", "dataset.test_tasks=8",
            "dataset.validation_tasks=8", "output.plots=false", "output.progress=false",
            "privacy.epsilon_budget=100"]  # fmt: skip
    result = _capped(tmp_path / "out", 1.0, sets, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "completed 2" in result.stdout
