"""The official Omniglot one-shot classification runs of Lake et al. (2015).

Lake, Salakhutdinov and Tenenbaum's 20 within-alphabet, 20-way, one-shot runs (``all_runs.zip`` in
the Omniglot repository, ``python/one-shot-classification/``). Run ``NN`` (01..20) holds one
drawing of each of 20 characters of one evaluation alphabet (``runNN/training/classKK.png``), 20
further drawings of those characters by other people (``runNN/test/itemKK.png``), and
``runNN/class_labels.txt``, whose lines ``runNN/test/itemKK.png runNN/training/classJJ.png`` say
which character each test item is. People err on 4.5% of the items (Lake et al. 2015).

:func:`load_oneshot_runs` turns each run into one :class:`~metalearning.tasks.Task`: the 20
training drawings are the support set (``classKK`` has label ``KK - 1``), the 20 test items the
query set (labelled with their ``class_labels.txt`` class). Pixels follow :func:`load_omniglot`
exactly - :func:`~metalearning.omniglot.decode_png` (grey > 127 is background), then
:func:`~metalearning.omniglot.resize_strokes` (antialiased bilinear to ``image_size``), then
float32 in [0, 1] with 1.0 = ink - so a model trained by fedmeta sees the same kind of input.
:func:`evaluate_oneshot_runs` adapts a meta-model on each run's training drawings with the inner
loop of :func:`~metalearning.evaluation.evaluate` and reports each run's error rate.
"""

from __future__ import annotations

import math
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from fedmeta.metalearning.errors import DataError
from fedmeta.metalearning.evaluation import task_scores
from fedmeta.metalearning.images import pixels_to_unit
from fedmeta.metalearning.items import ink_digests
from fedmeta.metalearning.omniglot import decode_png, resize_strokes
from fedmeta.metalearning.tasks import Task, stack_tasks

__all__ = [
    "HUMAN_ERROR_RATE",
    "ONESHOT_RUNS",
    "ONESHOT_WAYS",
    "OneShotResult",
    "OneShotRun",
    "evaluate_oneshot_runs",
    "load_oneshot_runs",
]

ONESHOT_RUNS = 20
ONESHOT_WAYS = 20
#: People's mean error on the 20 runs (Lake, Salakhutdinov and Tenenbaum 2015, Science 350:1332).
HUMAN_ERROR_RATE = 0.045
_SIDE = 105  # every Omniglot drawing, the runs' included
_LAYOUT = (
    "the official runs hold runNN/class_labels.txt, runNN/training/classKK.png and "
    "runNN/test/itemKK.png for NN, KK = 01..20"
)
_ENTRY_RE = re.compile(
    r"(?:^|/)(run\d\d/(?:class_labels\.txt|training/class\d\d\.png|test/item\d\d\.png))$"
)
_LABEL_RE = re.compile(
    r"^(?:\S*/)?(?P<run>run\d\d)/test/item(?P<item>\d\d)\.png"
    r"\s+(?:\S*/)?(?P<crun>run\d\d)/training/class(?P<cls>\d\d)\.png$"
)


@dataclass(frozen=True)
class OneShotRun:
    """One official run as a task: 20 training drawings (support) and 20 test items (query).

    ``task.support_y`` is ``0..19`` (``classKK`` -> ``KK - 1``); ``task.query_y[i]`` is the class
    of ``itemII`` (``II = i + 1``) according to ``class_labels.txt``.
    """

    name: str
    task: Task
    #: Each drawing's item digest (metalearning/items.py: its ink mask at 105 x 105), the 20
    #: training drawings then the 20 test items: what tells a model's training data apart.
    item_ids: np.ndarray | None = None


@dataclass(frozen=True)
class OneShotResult:
    """Error rates on the official runs: each run's fraction of its 20 test items misclassified."""

    runs: tuple[str, ...]
    errors: tuple[float, ...]
    mean_error: float


class _Source:
    """The run files of a zip or a folder, addressed as ``runNN/...``."""

    def __init__(self, path: Path) -> None:
        self.zip_entries: dict[str, bytes] | None = None
        self.root = path
        if path.is_file():
            self._read_zip(path)
        elif (path / "run01").is_dir():
            self.root = path
        elif (path / "all_runs").is_dir():
            self.root = path / "all_runs"
        elif (path / "all_runs.zip").is_file():
            self._read_zip(path / "all_runs.zip")
        else:
            raise DataError(
                f"no Omniglot one-shot runs at {path}: expected all_runs.zip, a folder holding "
                "run01 .. run20, or a folder holding all_runs/ or all_runs.zip"
            )

    def _read_zip(self, path: Path) -> None:
        self.root = path
        self.zip_entries = {}
        try:
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    m = _ENTRY_RE.search(info.filename)
                    if not m:
                        continue
                    if m[1] in self.zip_entries:
                        raise DataError(f"{path}: holds {m[1]} twice; keep one copy of the runs")
                    self.zip_entries[m[1]] = z.read(info)
        except zipfile.BadZipFile as e:
            raise DataError(f"{path}: not a valid zip file ({e}); expected all_runs.zip") from e

    def where(self, rel: str) -> str:
        """A file's location for messages: ``zip:runNN/...`` or the path."""
        return f"{self.root}:{rel}" if self.zip_entries is not None else str(self.root / rel)

    def read(self, rel: str) -> bytes:
        """The bytes of ``rel``; a missing file is named in a one-line DataError."""
        if self.zip_entries is not None:
            data = self.zip_entries.get(rel)
        else:
            f = self.root / rel
            data = f.read_bytes() if f.is_file() else None
        if data is None:
            raise DataError(f"{self.root}: {rel} is missing; {_LAYOUT}")
        return data


def _labels(src: _Source, run: str) -> dict[int, int]:
    """``class_labels.txt`` of ``run`` as test item number -> training class number (1-based)."""
    rel = f"{run}/class_labels.txt"
    out: dict[int, int] = {}
    text = src.read(rel).decode("utf-8", errors="replace")
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        m = _LABEL_RE.match(line.strip())
        if not m or m["run"] != run or m["crun"] != run:
            raise DataError(
                f"{src.where(rel)}, line {lineno}: expected '{run}/test/itemKK.png "
                f"{run}/training/classJJ.png'; got {line.strip()!r}"
            )
        item, cls = int(m["item"]), int(m["cls"])
        for kind, k in (("item", item), ("class", cls)):
            if not 1 <= k <= ONESHOT_WAYS:
                raise DataError(
                    f"{src.where(rel)}, line {lineno}: {kind}{k:02d} is not one of the run's "
                    f"{kind}01 .. {kind}{ONESHOT_WAYS:02d}"
                )
        if item in out:
            raise DataError(f"{src.where(rel)}, line {lineno}: item{item:02d} is listed twice")
        out[item] = cls
    missing = sorted(set(range(1, ONESHOT_WAYS + 1)) - set(out))
    if missing:
        raise DataError(
            f"{src.where(rel)}: item{missing[0]:02d} has no line; every test item "
            f"item01 .. item{ONESHOT_WAYS:02d} needs one"
        )
    return out


def _drawing(src: _Source, rel: str) -> np.ndarray:
    """A run's PNG as white-True bool [105, 105], checked against the official convention."""
    white = decode_png(src.read(rel), src.where(rel))
    if white.shape != (_SIDE, _SIDE):
        raise DataError(
            f"{src.where(rel)}: is {white.shape[1]}x{white.shape[0]} pixels; the official runs are "
            f"{_SIDE}x{_SIDE} like every Omniglot drawing"
        )
    if (~white).mean() > 0.5:
        raise DataError(
            f"{src.where(rel)}: more than half of it is ink; Omniglot drawings are dark strokes "
            "on a white background (is the image inverted?)"
        )
    return white


def _run(src: _Source, run: str, image_size: int) -> OneShotRun:
    labels = _labels(src, run)
    names = [f"{run}/training/class{k:02d}.png" for k in range(1, ONESHOT_WAYS + 1)]
    names += [f"{run}/test/item{k:02d}.png" for k in range(1, ONESHOT_WAYS + 1)]
    white = np.stack([_drawing(src, n) for n in names])
    x = pixels_to_unit(resize_strokes(white, image_size))  # exactly load_omniglot's pixels
    support_y = torch.arange(ONESHOT_WAYS)
    query_y = torch.tensor([labels[k] - 1 for k in range(1, ONESHOT_WAYS + 1)])
    task = Task(x[:ONESHOT_WAYS], support_y, x[ONESHOT_WAYS:], query_y)
    return OneShotRun(run, task, ink_digests(white, ink=False))


def load_oneshot_runs(path: str | Path, *, image_size: int = 28) -> list[OneShotRun]:
    """Read the 20 official runs from ``all_runs.zip`` or its unpacked folder.

    ``path`` is the zip, a folder holding ``run01`` .. ``run20``, or a folder holding
    ``all_runs/`` or ``all_runs.zip`` (the zip's entries may sit under a top folder). Drawings are
    preprocessed exactly as :func:`~metalearning.omniglot.load_omniglot` does, at ``image_size``
    (the model's input side). A missing or malformed file raises a one-line
    :class:`~metalearning.errors.DataError` naming it.
    """
    src = _Source(Path(path))
    return [_run(src, f"run{r:02d}", image_size) for r in range(1, ONESHOT_RUNS + 1)]


def _check_model(model: nn.Module, x: Tensor) -> None:
    """Refuse a model that does not map the runs' images to 20 logits, saying what to do.

    The module's own parameters suffice: the output width does not depend on their values.
    """
    p = next(iter(model.parameters()), None)
    try:
        with torch.no_grad():
            width = int(model(x.to(p.device if p is not None else "cpu")).shape[-1])
    except RuntimeError as e:
        raise ValueError(
            f"the model does not take the runs' images {list(x.shape[1:])} ({e}); load the runs "
            "with the model's image_size and use a one-channel model"
        ) from e
    if width != ONESHOT_WAYS:
        raise ValueError(
            f"the official runs are {ONESHOT_WAYS}-way; this model is {width}-way: train with "
            "configs/omniglot-20way-1shot.toml"
        )


def evaluate_oneshot_runs(
    model: nn.Module,
    params: Mapping[str, Tensor] | Tensor | None,
    runs: str | Path | Sequence[OneShotRun],
    *,
    inner_steps: int = 10,
    inner_lr: float = 0.4,
    image_size: int = 28,
    device: str | torch.device | None = "auto",
    inner_grad_clip: float = math.inf,
    step_check: bool = False,
) -> OneShotResult:
    """Error rate of a meta-model on each official run, and their mean.

    Each run is adapted separately from ``params`` on its 20 training drawings (one per class)
    with ``inner_steps`` SGD steps at ``inner_lr`` - the inner loop of
    :func:`~metalearning.evaluation.evaluate`, through
    :func:`~metalearning.evaluation.task_scores`, with
    per-task batch statistics - then its 20 test items are classified. ``runs`` is what
    :func:`load_oneshot_runs` returns, or a path for it (read at ``image_size``). Compare the mean
    with people's 4.5% (:data:`HUMAN_ERROR_RATE`).
    """
    loaded = (
        load_oneshot_runs(runs, image_size=image_size) if isinstance(runs, str | Path) else runs
    )
    if not loaded:
        raise ValueError("evaluate_oneshot_runs needs at least one run")
    _check_model(model, loaded[0].task.support_x)
    tasks = stack_tasks([r.task for r in loaded])
    accuracy = task_scores(
        model, params, tasks, inner_steps=inner_steps, inner_lr=inner_lr, device=device,
        inner_grad_clip=inner_grad_clip, step_check=step_check,
    )  # fmt: skip
    # Each score is k / 20 in float32: count the misclassified items exactly.
    items = int(tasks.query_y.shape[1])
    errors = tuple(round(float(1 - a) * items) / items for a in accuracy)
    return OneShotResult(tuple(r.name for r in loaded), errors, sum(errors) / len(errors))
