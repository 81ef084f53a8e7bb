"""The fedmeta ClientApp (Flower Message API): decode, compute (fedmeta.client.gradients), encode.

The participant id comes from the node config (``partition-id`` in simulation, ``participant-id``
in deployment). A request this version cannot read is answered with an error reply naming the
problem (the server counts it), never a guess.
"""

from __future__ import annotations

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedmeta import protocol as P
from fedmeta.client.gradients import gradient_reply, registration

app = ClientApp()


def data_path(context: Context) -> str | None:
    """The node's own data folder (node config ``data-path``); None in simulation."""
    value = context.node_config.get(P.NODE_DATA_PATH)
    return None if value in (None, "") else str(value)


def participant_id(context: Context) -> str:
    """This node's participant id, from its node config."""
    node_config = context.node_config
    for key in (P.NODE_PARTICIPANT_ID, P.NODE_PARTITION_ID):
        if key in node_config:
            return str(node_config[key])
    raise ValueError(
        f"node_config must hold {P.NODE_PARTICIPANT_ID!r} or {P.NODE_PARTITION_ID!r}; "
        f"got {dict(node_config)}: start the SuperNode with --node-config 'participant-id=ID'"
    )


@app.query()
def query(message: Message, context: Context) -> Message:
    """Registration: who this participant is and how many tasks it holds."""
    request = P.decode_register_request(message.content)
    reply = registration(request, participant_id(context), data_path(context))
    return Message(P.encode_registration(reply), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round's work: the clipped per-task query gradients of the requested tasks."""
    torch.set_num_threads(1)  # one participant per core in simulation
    request = P.decode_gradient_request(message.content)
    reply = gradient_reply(request, participant_id(context), data_path(context))
    # The in-process grid's nodes share the server's memory: the rows cross without a copy.
    shared = bool(context.node_config.get(P.NODE_SHARED_MEMORY, False))
    return Message(P.encode_gradient_reply(reply, shared=shared), reply_to=message)
