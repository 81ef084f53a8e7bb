"""fedmeta: differentially private federated meta-learning.

The distribution is split into plain packages so that each piece can be imported on its own:

* ``accounting`` -- privacy mathematics and the durable budget ledger (no torch, no flwr);
* ``metalearning`` -- the meta-learning workload (task data, models, per-task clipped MAML
  gradients);
* ``server`` / ``client`` -- the Flower ServerApp and ClientApp and the round logic;
* ``fedmeta`` -- the typed configuration, the wire-format keys shared by client and server, the CLI.
"""

__version__ = "0.1.0"
