"""Former home of the task data; kept only so that old imports keep working.

``metalearning/data.py`` was split into modules named for what they hold (``tasks``,
``sinusoid``, ``images``, ``omniglot``, ``federated``, ``digests``, ``errors``). Import from
``metalearning`` (or those modules) instead. This module re-exports the names it used to define
because ``bench/compute.py`` and ``bench/compute_accuracy.py`` still import ``Task`` from it; delete
it once they import ``metalearning.Task``.
"""

from __future__ import annotations

from metalearning.digests import verify_checksum
from metalearning.errors import ChecksumError, DataError
from metalearning.federated import (
    FederatedTaskSet,
    ParticipantTasks,
    SinusoidParticipant,
    partition_classes,
)
from metalearning.images import ClassDataset, DataSplits, load_image_folder
from metalearning.omniglot import OMNIGLOT_FILES, download_omniglot, load_omniglot
from metalearning.sinusoid import SinusoidTasks
from metalearning.tasks import Task, sample_tasks, stack_tasks

__all__ = [
    "ChecksumError",
    "ClassDataset",
    "DataError",
    "DataSplits",
    "FederatedTaskSet",
    "OMNIGLOT_FILES",
    "ParticipantTasks",
    "SinusoidParticipant",
    "SinusoidTasks",
    "Task",
    "download_omniglot",
    "load_image_folder",
    "load_omniglot",
    "partition_classes",
    "sample_tasks",
    "stack_tasks",
    "verify_checksum",
]
