"""The warm worker's warm-up: one registration and one gradient before the first real task.

The first gradient in a process pays torch's lazy initialisation (seconds); the first request for
a configuration builds its workload (data loading included). The worker
(``client/fedmeta/client/worker.py``) runs both through the ClientApp at start, so that they stay
out of round 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fedmeta.client import flower_internals as fi

#: The clip bound of the warm-up's gradient request. Any bound will do: the reply is discarded
#: (a clip is a round's parameter, not configuration).
WARM_UP_CLIP = 1.0


def warm_up(app: Any, node_config: dict[str, Any], config_path: Path | None = None) -> float:
    """Run one registration and one gradient through ``app``; returns the seconds spent.

    ``config_path``: the federation's configuration, so that its workload is the one built (the
    default configuration's sinusoid warms torch only): the requests carry its participants' part
    (``client_config``), as the server's do.
    """
    import numpy as np
    from flwr.app import Context, Message, RecordDict

    from fedmeta import protocol as P
    from fedmeta.client_config import client_config
    from fedmeta.config_io import load_config

    t0 = time.perf_counter()
    cfg = client_config(load_config(config_path))
    sent = cfg.model_dump_json()
    fi.ensure_task_identity()  # Message() reads it; a real task sets it again
    context = Context(run_id=0, node_id=0, node_config=dict(node_config), state=RecordDict(),
                      run_config={})  # fmt: skip
    query = Message(P.encode_register_request(P.RegisterRequest("warm-up", sent)),
                    0, P.MSG_REGISTER)  # fmt: skip
    fi.set_message_id(query, "warm-up-register")
    registration = P.decode_registration(app(message=query, context=context).content)
    from fedmeta.workload import build_model, initial_params

    params = initial_params(cfg, build_model(cfg)).numpy().astype(np.float32)
    ids = tuple(range(min(2, registration.task_count)))
    request = P.GradientRequest("warm-up", 0, ids, WARM_UP_CLIP, params, sent)
    train = Message(P.encode_gradient_request(request), 0, P.MSG_TRAIN)
    fi.set_message_id(train, "warm-up-train")
    app(message=train, context=context)
    return time.perf_counter() - t0
