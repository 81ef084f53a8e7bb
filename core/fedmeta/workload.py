"""Adapter from the fedmeta configuration to the workload package (``metalearning``).

Shared by the client (participant task lists, per-task clipped gradients) and the server (model,
initial parameters, held-out validation / test / probe tasks, the data's identity). Everything here
is a pure function of the configuration and the data: a participant rebuilds exactly its own
numbered tasks in any process, so task ids are stable across rounds and restarts.

**The data's identity** keys the privacy budget. Image data is named by its items: each one's
content digest at source resolution and its look, a perceptual hash of the model's input
(metalearning/items.py, fedmeta/item_identity.py; ``participant_fingerprint`` sends a
participant's item set to the server), so near-duplicates and the same drawings through another
loader, file format, path or node key spend from the same budget, and a subset, superset or
reshuffle is charged with what the data it overlaps has spent
(accounting/fedmeta/accounting/ledger/overlap.py). The
synthetic sinusoid is named by its generator and seed (``declared_identity``) plus the
participant's index. See server/fedmeta/server/budget_keys.py. ``data_fingerprint`` is a digest of
the source files (or the sinusoid generator's full specification): recorded, never a key.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import numpy as np
import torch
from torch import Tensor, nn

from fedmeta.client_config import ClientConfig, ClientDatasetConfig, client_config
from fedmeta.config import GROUP_NORM_GROUPS, Config, DatasetConfig
from fedmeta.item_identity import DataItems

if TYPE_CHECKING:  # metalearning is imported when a workload is built, not with this module
    from fedmeta.accounting.ledger.public import PublicDataUse
    from fedmeta.metalearning.federated import (
        FederatedTaskSet,
        ParticipantTasks,
        SinusoidParticipant,
    )
    from fedmeta.metalearning.images import ClassDataset, DataSplits
    from fedmeta.metalearning.maml import Metric
    from fedmeta.metalearning.models import TrainedParameters
    from fedmeta.metalearning.warm_start import WarmStart

_PUBLIC_DESCRIPTION = "Omniglot background alphabets (dataset.split = 'evaluation')"
_VAL_SEED_SALT = 0x5EED_0001
_TEST_SEED_SALT = 0x5EED_0002
_PROBE_SEED_SALT = 0x5EED_0003


#: The server's held-out task sets, each from its own seed (and, for image data, its own classes).
HeldOut: TypeAlias = Literal["validation", "test", "probe"]
_SALTS: dict[HeldOut, int] = {
    "validation": _VAL_SEED_SALT, "test": _TEST_SEED_SALT, "probe": _PROBE_SEED_SALT,
}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """The model and the data of one configuration.

    Built once (:func:`build_workload`): by the server at the start of a run, by a participant
    once per configuration it receives; then passed down, never rebuilt from the configuration.
    Both build it from the same :class:`~fedmeta.client_config.ClientConfig` (the server's adds
    the public warm start, which only the server runs).
    """

    model: nn.Module
    metric: Metric  # how held-out tasks are scored: mse (lower is better) or accuracy
    task_set: FederatedTaskSet
    splits: DataSplits | None  # None: the sinusoid has no image splits
    dataset: ClientDatasetConfig
    seed: int
    zero_head: bool = False  # training.zero_head: the N-way head starts at zero (Kao et al. 2022)
    warm_start: WarmStart | None = None  # public.warm_start: pre-trained on the public classes
    trained_parameters: TrainedParameters = "all"  # training.trained_parameters

    @functools.cached_property
    def trained_coordinates(self) -> Tensor | None:
        """Positions of the privately trained meta-parameters in the flat vector (None: all)."""
        from fedmeta.metalearning import trained_coordinates

        return trained_coordinates(self.model, self.trained_parameters)

    @property
    def trained_dim(self) -> int:
        """How many meta-parameters private training updates: the length of a gradient row."""
        coords = self.trained_coordinates
        return self.param_count if coords is None else int(coords.numel())

    @property
    def param_count(self) -> int:
        """How many meta-parameters the model has (the flat vector's length)."""
        return sum(p.numel() for p in self.model.parameters())

    @property
    def higher_is_better(self) -> bool:
        """Accuracy: higher is better; MSE: lower."""
        return self.metric == "accuracy"

    @property
    def validation_is_test(self) -> bool:
        """Whether validation tasks would come from the test classes (no validation split)."""
        if self.splits is None:  # sinusoid: validation and test tasks have their own seeds
            return False
        return bool(self.splits.val.n_classes < self.dataset.ways)

    def initial_params(self) -> Tensor:
        """Flat float32 initial meta-parameters (pre-trained once per workload).

        A function of the public seed and, with a public warm start, of the public classes.
        """
        return self._initial.clone()

    @functools.cached_property
    def _initial(self) -> Tensor:
        params = _initial_params(self.model, self.seed, self.zero_head)
        if self.warm_start is None:
            return params
        from fedmeta.metalearning import check_disjoint, default_cache_dir, public_warm_start

        splits, public = self.splits, self.public_classes
        assert splits is not None and public is not None  # image data, a warm start
        check_disjoint(public, [splits.train, splits.val, splits.test])
        ds = self.dataset
        return public_warm_start(self.model, params, public, self.warm_start,
                                 n_way=ds.ways, k_shot=ds.shots, q_query=ds.query,
                                 seed=self.seed, cache_dir=default_cache_dir())  # fmt: skip

    @functools.cached_property
    def public_classes(self) -> ClassDataset | None:
        """The classes ``dataset.split`` declares public, read once, when a warm start needs them.

        Only the server pre-trains, so a participant never reads them. Cached: the warm start,
        the summary and the ledger's declaration all ask, and each read decodes the image files.
        """
        return None if self.warm_start is None else _public_classes(self.dataset)

    def trained_summary(self) -> dict[str, Any]:
        """Which meta-parameters private training updated, for the summary and the records."""
        return {"which": self.trained_parameters, "count": self.trained_dim,
                "of": self.param_count}  # fmt: skip

    def public_summary(self) -> dict[str, Any] | None:
        """What was public, for the summary and the records (None: nothing was)."""
        public = self.public_classes
        if self.warm_start is None or public is None:
            return None
        return {
            "data": _PUBLIC_DESCRIPTION,
            "classes": public.n_classes,
            "groups": len(set(public.groups)),
            "digest": public.digest(),
            "disjoint_from_private": True,  # check_disjoint refuses any shared class
            "non_private_pretraining": dataclasses.asdict(self.warm_start),
        }

    def public_data_use(self) -> PublicDataUse | None:
        """The ledger's record of the public data (None: nothing public was used)."""
        from fedmeta.accounting.ledger.public import PublicDataUse  # the server's: no participant

        summary = self.public_summary()
        if summary is None or self.warm_start is None:
            return None
        steps = self.warm_start.steps
        return PublicDataUse(
            description=summary["data"],
            digest=summary["digest"],
            items=summary["classes"],
            use=f"non-private meta-training ({steps} steps) before private training",
            disjoint_from_private=summary["disjoint_from_private"],
        )

    def held_out(self, which: HeldOut, n_tasks: int) -> Any:
        """Server-side held-out tasks (batched ``Task``).

        Sinusoid: fresh tasks from the whole distribution with their own seeds. Image data: tasks
        over the validation (``validation``/``probe``) or test classes, which no participant owns.
        If the validation split is empty (Omniglot's background/evaluation split), validation uses
        test classes.
        """
        from fedmeta.metalearning import SinusoidTasks, sample_tasks

        seed = (self.seed * 1_000_003 + _SALTS[which]) % (2**63)
        ds = self.dataset
        if ds.name == "sinusoid":
            return SinusoidTasks(ds.shots, ds.query).sample(n_tasks, seed)
        assert self.splits is not None  # image data
        # The one fallback rule, which model selection's refusal reads too (validation_is_test).
        split = self.splits.test if which == "test" or self.validation_is_test else self.splits.val
        return sample_tasks(
            split, n_way=ds.ways, k_shot=ds.shots, q_query=ds.query, n_tasks=n_tasks, seed=seed
        )


def build_model(cfg: Config | ClientConfig) -> nn.Module:
    """The meta-model for the configured dataset."""
    from fedmeta.metalearning import ConvNet4, SinusoidMLP, with_learned_inner_rates

    ds = cfg.dataset
    model: nn.Module
    if ds.name == "sinusoid":
        model = SinusoidMLP()
    else:
        channels = 1 if ds.name == "omniglot" else 3
        model = ConvNet4(
            ds.ways,
            in_channels=channels,
            hidden=ds.filters,
            groups=GROUP_NORM_GROUPS,
            image_size=ds.image_size,
            norm=ds.norm,
        )
    if cfg.training.meta_sgd:
        model = with_learned_inner_rates(model, cfg.training.inner_lr)
    return model


def initial_params(cfg: Config | ClientConfig, model: nn.Module) -> Tensor:
    """Flat float32 meta-parameters from the public seed alone (no public warm start)."""
    return _initial_params(model, cfg.seed, cfg.training.zero_head)


def _initial_params(model: nn.Module, seed: int, zero_head: bool) -> Tensor:
    from fedmeta.metalearning import flatten_params, init_params

    params = init_params(model, seed, zero_head=zero_head)
    return flatten_params(params).to(torch.float32).contiguous()


@functools.lru_cache(maxsize=4)
def _splits(
    name: str, path: str, image_size: int, seed: int, split: str, rotations: bool, download: bool
) -> Any:
    """The image data, read once per process per source (several workloads may share it)."""
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


def build_workload(cfg: Config | ClientConfig) -> Workload:
    """The workload of ``cfg`` (reads the data: a missing or malformed source is a DataError).

    A participant builds it from the :class:`ClientConfig` it is sent; the server from its whole
    configuration, through the same one (so the two cannot differ), with the public warm start.
    """
    from fedmeta.metalearning import FederatedTaskSet

    sent = cfg if isinstance(cfg, ClientConfig) else client_config(cfg)
    ds, tr = sent.dataset, sent.training
    model = build_model(sent)
    if ds.name == "sinusoid":
        tasks = FederatedTaskSet.sinusoid(
            sent.federation.participants,
            tasks_per_participant=ds.tasks_per_participant,
            k_support=ds.shots,
            k_query=ds.query,
            seed=sent.seed,
        )
        return Workload(model, "mse", tasks, None, ds, sent.seed, tr.zero_head,
                        trained_parameters=tr.trained_parameters)  # fmt: skip
    splits, tasks = _image_tasks(ds, sent.federation.participants, sent.seed)
    warm = None if isinstance(cfg, ClientConfig) else _warm_start(cfg)
    return Workload(model, "accuracy", tasks, splits, ds, sent.seed, tr.zero_head, warm,
                    tr.trained_parameters)  # fmt: skip


@functools.lru_cache(maxsize=2)
def _public_classes(ds: ClientDatasetConfig) -> ClassDataset:
    """The classes ``dataset.split`` declares public (Omniglot's background alphabets)."""
    from fedmeta.metalearning import load_omniglot_public

    assert ds.path is not None  # the configuration requires it for image data
    return load_omniglot_public(ds.path, split=ds.split, rotations=ds.rotations,
                                image_size=ds.image_size)  # fmt: skip


def _warm_start(cfg: Config) -> WarmStart | None:
    """``public``'s pre-training with the private training's inner loop (None: no warm start)."""
    from fedmeta.adaptation import inner_kwargs
    from fedmeta.metalearning import WarmStart

    pub, tr = cfg.public, cfg.training
    if not pub.warm_start:
        return None
    inner = inner_kwargs(tr, evaluation=False)
    return WarmStart(pub.steps, pub.tasks_per_step, pub.meta_lr, tr.inner_steps, tr.inner_lr,
                     tr.first_order, inner["inner_grad_clip"], inner["step_check"])  # fmt: skip


@functools.lru_cache(maxsize=4)
def _image_tasks(
    ds: ClientDatasetConfig, participants: int, seed: int
) -> tuple[DataSplits, FederatedTaskSet]:
    """The image splits and the participants' task set, built once per process per setting.

    Partitioning the classes and numbering every participant's tasks is slow for Omniglot, and the
    server and the in-process participants of a simulation (and the benchmarks) build workloads of
    the same data, so the result is shared: keyed by the frozen settings it is a function of, not
    by the configuration's text.
    """
    from fedmeta.metalearning import FederatedTaskSet

    assert ds.path is not None  # the configuration requires it for image data
    splits = _splits(ds.name, ds.path, ds.image_size, seed, ds.split, ds.rotations, ds.download)
    partition = ds.partition
    if partition == "auto":
        partition = "group" if ds.name == "omniglot" else "even"
    tasks = FederatedTaskSet.from_classes(
        splits.train,
        participants,
        n_way=ds.ways,
        k_shot=ds.shots,
        q_query=ds.query,
        tasks_per_participant=ds.tasks_per_participant,
        partition=partition,
        disjoint_examples=ds.disjoint_examples,
        seed=seed,
    )
    return splits, tasks


def own_data(cfg: ClientConfig, data_path: str | None) -> ClientConfig:
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
    return cfg.model_copy(update={"dataset": dataset, "federation": federation})


def participant_tasks(
    wl: Workload, participant_id: str, data_path: str | None = None
) -> ParticipantTasks | SinusoidParticipant:
    """The numbered tasks of one participant of ``wl``.

    ``wl`` is built from :func:`own_data`'s configuration: with its own data the participant is
    the workload's only one, ``"0"``.
    """
    if data_path is None or wl.dataset.name == "sinusoid":
        return wl.task_set.participant(participant_id)
    return wl.task_set.participant("0")


def check_data(cfg: Config) -> Workload:
    """Read the data once, so a missing or malformed source is one ``DataError`` at the start.

    In simulation every participant's tasks come from the same source; checking it here, before
    any participant starts, replaces thousands of lines of tracebacks from participant processes.
    Returns the workload, for the run to use.
    """
    wl = build_workload(cfg)
    wl.held_out("validation", 1)
    return wl


SINUSOID_GENERATOR = "sinusoid-v1"


def participant_fingerprint(
    cfg: ClientConfig, tasks: ParticipantTasks | SinusoidParticipant, data_path: str | None
) -> str:
    """What a participant tells the (trusted) server its data is.

    Image data: its items (``items-v2:...``, fedmeta/item_identity.py), every item of the classes
    its tasks are drawn from, each by its exact digest and its look (what the model sees); the
    budget is charged by overlap with them (ledger/overlap.py). Data without item digests (the
    sinusoid): ``data_fingerprint``. The item set is the floor's, so a participant imports
    neither the accountant nor SQLite (issue 54).
    """
    from fedmeta.metalearning.federated import ParticipantTasks

    if isinstance(tasks, ParticipantTasks):
        items = tasks.dataset.items_of(tasks.classes)
        if items is not None and len(items):
            return DataItems.of(items, tasks.dataset.looks_of(tasks.classes)).to_text()
    return data_fingerprint(own_data(cfg, data_path))


def source_items(ds: DatasetConfig, seed: int) -> np.ndarray | None:
    """Every item digest of the configured source (None: generated data, no items).

    Omniglot: all 32,460 drawings whatever the split (``omniglot_item_ids``, cached by file
    stat); an image folder: every image it holds (read under the public ``seed``).
    """
    if ds.name == "sinusoid" or ds.path is None:
        return None
    from fedmeta.metalearning import omniglot_item_ids

    if ds.name == "omniglot":
        return omniglot_item_ids(Path(ds.path).expanduser())
    splits = _splits(ds.name, ds.path, ds.image_size, seed, ds.split, ds.rotations,
                     ds.download)  # fmt: skip
    parts = [s.item_ids for s in splits if s.item_ids is not None]
    return np.concatenate(parts) if parts else None


def declared_identity(dataset_name: str, seed: int) -> str:
    """The key of a data set's budgets, from ``dataset.name`` and the public ``seed``: stable.

    It must not change when participants come or go or edit their data, or each change would
    open a fresh budget (issue 18): the synthetic sinusoid is named by its generator and seed (the
    seed *is* that data); an image data set by its kind alone, so every run on Omniglot or on image
    folders composes, whatever files were added (conservative: two different folders share one
    budget family; a deployment keys participants by their node keys instead).
    """
    if dataset_name == "sinusoid":
        return f"sinusoid:{SINUSOID_GENERATOR}:seed={seed}"
    return dataset_name


def data_fingerprint(cfg: Config | ClientConfig) -> str:
    """A content digest of what a participant's tasks are drawn from (recorded, never a key).

    The ledger records it per participant and reports a change (an edit of that participant's
    data); the budget's key is ``declared_identity``.
    """
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
