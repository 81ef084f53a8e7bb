"""The meta-learning workload: task data, federated partitions, models, per-task clipped MAML grads.

Plain PyTorch + numpy; imports neither flwr nor prometheus_client. See ``docs/workload.md``.
"""

from fedmeta.metalearning.digests import verify_checksum
from fedmeta.metalearning.errors import ChecksumError, DataError
from fedmeta.metalearning.evaluation import (
    EvalResult,
    bootstrap_interval,
    diverged_tasks,
    evaluate,
    task_scores,
)
from fedmeta.metalearning.execution import resolve_device, resolve_method
from fedmeta.metalearning.federated import (
    FederatedTaskSet,
    ParticipantTasks,
    SinusoidParticipant,
    partition_classes,
)
from fedmeta.metalearning.images import (
    ClassDataset,
    DataSplits,
    image_folder_source_digest,
    load_image_folder,
)
from fedmeta.metalearning.items import image_item_digest, ink_digests
from fedmeta.metalearning.maml import (
    InnerLoop,
    clip_by_global_norm,
    per_task_clipped_grads,
    per_task_grads,
)
from fedmeta.metalearning.models import (
    INNER_RATES,
    ConvNet4,
    ParamSpec,
    SinusoidMLP,
    TrainedParameters,
    flatten_params,
    init_params,
    inner_rates,
    param_spec,
    trained_coordinates,
    unflatten_params,
    with_learned_inner_rates,
)
from fedmeta.metalearning.omniglot import (
    default_cache_dir,
    download_omniglot,
    load_omniglot,
    load_omniglot_public,
    omniglot_source_digest,
)
from fedmeta.metalearning.omniglot_items import omniglot_item_ids
from fedmeta.metalearning.oneshot_runs import (
    OneShotResult,
    OneShotRun,
    evaluate_oneshot_runs,
    load_oneshot_runs,
)
from fedmeta.metalearning.sinusoid import SinusoidTasks
from fedmeta.metalearning.tasks import Task, sample_tasks, stack_tasks
from fedmeta.metalearning.warm_start import (
    WarmStart,
    check_disjoint,
    meta_train,
    public_warm_start,
)

__all__ = [
    "INNER_RATES",
    "ChecksumError",
    "ClassDataset",
    "ConvNet4",
    "DataError",
    "DataSplits",
    "EvalResult",
    "FederatedTaskSet",
    "InnerLoop",
    "OneShotResult",
    "OneShotRun",
    "ParamSpec",
    "ParticipantTasks",
    "SinusoidMLP",
    "SinusoidParticipant",
    "SinusoidTasks",
    "Task",
    "TrainedParameters",
    "WarmStart",
    "bootstrap_interval",
    "check_disjoint",
    "clip_by_global_norm",
    "default_cache_dir",
    "diverged_tasks",
    "download_omniglot",
    "evaluate",
    "evaluate_oneshot_runs",
    "flatten_params",
    "image_folder_source_digest",
    "image_item_digest",
    "ink_digests",
    "init_params",
    "inner_rates",
    "load_image_folder",
    "load_omniglot",
    "load_omniglot_public",
    "load_oneshot_runs",
    "meta_train",
    "omniglot_item_ids",
    "omniglot_source_digest",
    "param_spec",
    "partition_classes",
    "per_task_clipped_grads",
    "per_task_grads",
    "public_warm_start",
    "resolve_device",
    "resolve_method",
    "sample_tasks",
    "stack_tasks",
    "task_scores",
    "trained_coordinates",
    "unflatten_params",
    "verify_checksum",
    "with_learned_inner_rates",
]
