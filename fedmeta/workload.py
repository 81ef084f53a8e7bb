"""Adapter from the fedmeta configuration to the workload package (``metalearning``).

Shared by the client (participant task lists, per-task clipped gradients) and the server (model,
initial parameters, held-out validation / test / probe tasks, the data's identity). Everything here
is a pure function of the configuration and the data: a participant rebuilds exactly its own
numbered tasks in any process, so task ids are stable across rounds and restarts.

**The data's identity** keys the privacy budget: runs over the same data spend from one budget,
whatever their seed, output directory or training settings. It names the *source* of the tasks:
for Omniglot and image folders a SHA-256 over the source files (independent of split, partition,
seed and number of participants, so every run that reads those images composes); for the synthetic
sinusoid the generator's specification, because there the seed and sizes *are* the data.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedmeta.config import Config

_VAL_SEED_SALT = 0x5EED_0001
_TEST_SEED_SALT = 0x5EED_0002
_PROBE_SEED_SALT = 0x5EED_0003


@dataclass(frozen=True)
class Workload:
    """The model and the data of one configuration."""

    model: nn.Module
    metric: str  # "mse" (lower is better) or "accuracy"
    task_set: Any  # metalearning.FederatedTaskSet
    splits: Any  # DataSplits or None (sinusoid)

    @property
    def higher_is_better(self) -> bool:
        """Accuracy: higher is better; MSE: lower."""
        return self.metric == "accuracy"


def build_model(cfg: Config) -> nn.Module:
    """The meta-model for the configured dataset."""
    from fedmeta.metalearning import ConvNet4, SinusoidMLP

    ds = cfg.dataset
    if ds.name == "sinusoid":
        return SinusoidMLP()
    channels = 1 if ds.name == "omniglot" else 3
    return ConvNet4(ds.ways, in_channels=channels, image_size=ds.image_size, norm=ds.norm)


def initial_params(cfg: Config, model: nn.Module) -> Tensor:
    """Flat float32 initial meta-parameters (a function of the public seed)."""
    from fedmeta.metalearning import flatten_params, init_params

    params = init_params(model, cfg.seed, zero_head=cfg.training.zero_head)
    return flatten_params(params).to(torch.float32).contiguous()


@functools.lru_cache(maxsize=4)
def _splits(
    name: str, path: str, image_size: int, seed: int, split: str, rotations: bool, download: bool
) -> Any:
    from fedmeta.metalearning import load_image_folder, load_omniglot

    if name == "omniglot":
        return load_omniglot(
            path,
            split=split,
            rotations=rotations,
            image_size=image_size,
            seed=seed,
            download=download,
        )
    return load_image_folder(path, image_size=image_size, seed=seed)


@functools.lru_cache(maxsize=4)
def _workload(cfg_json: str) -> Workload:
    from fedmeta.metalearning import FederatedTaskSet

    cfg = Config.model_validate_json(cfg_json)
    ds = cfg.dataset
    model = build_model(cfg)
    if ds.name == "sinusoid":
        tasks = FederatedTaskSet.sinusoid(
            cfg.federation.participants,
            tasks_per_participant=ds.tasks_per_participant,
            k_support=ds.shots,
            k_query=ds.query,
            seed=cfg.seed,
        )
        return Workload(model, "mse", tasks, None)
    assert ds.path is not None
    splits = _splits(ds.name, ds.path, ds.image_size, cfg.seed, ds.split, ds.rotations, ds.download)
    partition = ds.partition
    if partition == "auto":
        partition = "group" if ds.name == "omniglot" else "even"
    tasks = FederatedTaskSet.from_classes(
        splits.train,
        cfg.federation.participants,
        n_way=ds.ways,
        k_shot=ds.shots,
        q_query=ds.query,
        tasks_per_participant=ds.tasks_per_participant,
        partition=partition,
        disjoint_examples=ds.disjoint_examples,
        seed=cfg.seed,
    )
    return Workload(model, "accuracy", tasks, splits)


def workload(cfg: Config) -> Workload:
    """The (process-cached) workload of ``cfg``."""
    return _workload(cfg.model_dump_json())


def own_data(cfg: Config, data_path: str | None) -> Config:
    """The configuration a participant computes with: its own data when its node names one.

    In a deployment every participant owns its data (node config ``data-path``): all of its tasks
    come from that folder, which it alone holds (one participant, no partition), never from the
    server's ``dataset.path``. In simulation the participants share one source and each takes its
    partition. The synthetic sinusoid has no files: its tasks come from the specification.
    """
    if data_path is None or cfg.dataset.name == "sinusoid":
        return cfg
    dataset = cfg.dataset.model_copy(update={"path": data_path})
    federation = cfg.federation.model_copy(update={"participants": 1})
    sampling = cfg.sampling.model_copy(update={"participants_per_round": 1})
    return cfg.model_copy(update={"dataset": dataset, "federation": federation,
                                  "sampling": sampling})  # fmt: skip


def participant_tasks(cfg: Config, participant_id: str, data_path: str | None = None) -> Any:
    """The numbered tasks of one participant (its own data when ``data_path`` is given)."""
    if data_path is None or cfg.dataset.name == "sinusoid":
        return workload(cfg).task_set.participant(participant_id)
    return workload(own_data(cfg, data_path)).task_set.participant("0")


def held_out_tasks(cfg: Config, which: str, n_tasks: int) -> Any:
    """Server-side held-out tasks (batched ``Task``).

    ``which`` is ``validation``, ``test`` or ``probe``.

    Sinusoid: fresh tasks from the whole distribution with their own seeds. Image data: tasks over
    the validation (``validation``/``probe``) or test classes, which no participant owns. If the
    validation split is empty (Omniglot's background/evaluation split), validation uses test
    classes.
    """
    from fedmeta.metalearning import SinusoidTasks, sample_tasks

    salt = {"validation": _VAL_SEED_SALT, "test": _TEST_SEED_SALT, "probe": _PROBE_SEED_SALT}[which]
    seed = (cfg.seed * 1_000_003 + salt) % (2**63)
    ds = cfg.dataset
    if ds.name == "sinusoid":
        return SinusoidTasks(ds.shots, ds.query).sample(n_tasks, seed)
    wl = workload(cfg)
    split = wl.splits.test if which == "test" else wl.splits.val
    if split.n_classes < ds.ways:
        split = wl.splits.test
    return sample_tasks(
        split, n_way=ds.ways, k_shot=ds.shots, q_query=ds.query, n_tasks=n_tasks, seed=seed
    )


def check_data(cfg: Config) -> None:
    """Read the data once, so a missing or malformed source is one ``DataError`` at the start.

    In simulation every participant's tasks come from the same source; checking it here, before
    any participant starts, replaces thousands of lines of tracebacks from participant processes.
    """
    workload(cfg)
    held_out_tasks(cfg, "validation", 1)


SINUSOID_GENERATOR = "sinusoid-v1"


def data_fingerprint(cfg: Config) -> str:
    """What a participant's tasks are drawn from (see the module docstring)."""
    ds = cfg.dataset
    if ds.name == "sinusoid":
        spec = {
            "generator": SINUSOID_GENERATOR,
            "seed": cfg.seed,
            "participants": cfg.federation.participants,
            "tasks_per_participant": ds.tasks_per_participant,
            "support": ds.shots,
            "query": ds.query,
        }
        return "sinusoid:" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()
    assert ds.path is not None  # the configuration requires it
    from fedmeta.metalearning import image_folder_source_digest, omniglot_source_digest

    digest = omniglot_source_digest if ds.name == "omniglot" else image_folder_source_digest
    return f"{ds.name}:{digest(Path(ds.path).expanduser())}"
