"""Wire format between the fedmeta ServerApp and ClientApp: every record name and key lives here.

Registration (message type ``query``)::

    server -> client  ConfigRecord REGISTER_REQUEST {run_id}
    client -> server  ConfigRecord REGISTER_REPLY   {participant_id, task_count, protocol_version}

Gradient request (message type ``train``)::

    server -> client  ArrayRecord WEIGHTS {PARAMS: float32 [dim]}     (flat meta-parameters)
                      ConfigRecord REQUEST {run_id, round_id, task_ids, clip, private, inner_steps,
                                            inner_lr, first_order, reply_format, param_dim}
    client -> server  ArrayRecord GRADS {GRADS: float32 [n_tasks, dim]}            (per_task)
                                     or {GRAD_SUM: float32 [dim]}                    (sum_and_norms)
                      ConfigRecord REPLY {run_id, round_id, participant_id, task_ids,
                                          task_norms (post-clip, sum_and_norms only)}
                      MetricRecord REPLY_METRICS {compute_seconds}

``task_counts`` are public metadata (see docs/federation.md). Replies never carry per-task pre-clip
norms: those are private and never leave the participant.
"""

from __future__ import annotations

from typing import Final

PROTOCOL_VERSION: Final = 1

# Message types (Flower categories; ClientApp handlers are @app.query() and @app.train()).
MSG_REGISTER: Final = "query"
MSG_TRAIN: Final = "train"

# Record names.
REGISTER_REQUEST: Final = "fedmeta.register"
REGISTER_REPLY: Final = "fedmeta.registration"
WEIGHTS: Final = "fedmeta.weights"
REQUEST: Final = "fedmeta.request"
GRADS: Final = "fedmeta.grads"
REPLY: Final = "fedmeta.reply"
REPLY_METRICS: Final = "fedmeta.reply_metrics"

# Array keys.
PARAMS: Final = "params"
GRADS_ARRAY: Final = "grads"
GRAD_SUM: Final = "grad_sum"

# Config keys.
RUN_ID: Final = "run_id"
ROUND_ID: Final = "round_id"
TASK_IDS: Final = "task_ids"
CLIP: Final = "clip"
PRIVATE: Final = "private"
INNER_STEPS: Final = "inner_steps"
INNER_LR: Final = "inner_lr"
FIRST_ORDER: Final = "first_order"
REPLY_FORMAT: Final = "reply_format"
PARAM_DIM: Final = "param_dim"
PARTICIPANT_ID: Final = "participant_id"
TASK_COUNT: Final = "task_count"
VERSION: Final = "protocol_version"
TASK_NORMS: Final = "task_norms"
COMPUTE_SECONDS: Final = "compute_seconds"

REPLY_PER_TASK: Final = "per_task"
REPLY_SUM_AND_NORMS: Final = "sum_and_norms"

# Flower node_config keys (simulation: partition-id / num-partitions; deployment may set
# participant-id).
NODE_PARTITION_ID: Final = "partition-id"
NODE_NUM_PARTITIONS: Final = "num-partitions"
NODE_PARTICIPANT_ID: Final = "participant-id"

# Flower run_config keys read by server/app.py and client/app.py (`flwr run .`, pyproject
# [tool.flwr.app.config]): a TOML config file and ``;``-separated ``key=value`` overrides.
RUN_CONFIG_FILE: Final = "config-file"
RUN_CONFIG_SET: Final = "set"
RUN_CONFIG_OUT: Final = "out"
RUN_CONFIG_RESUME: Final = "resume"
# The full validated configuration travels to clients as JSON inside the ServerApp-built
# run_config only in simulation; clients otherwise rebuild it from the same run_config keys.
