"""fedmeta: differentially private federated meta-learning.

One import package; each repository folder installs as a subpackage that can be imported on its
own (docs/architecture.md, "The floors"):

* ``fedmeta.accounting`` -- privacy mathematics and the durable budget ledger (no torch, no flwr);
* ``fedmeta.metalearning`` -- the meta-learning workload (task data, models, per-task clipped MAML
  gradients);
* ``fedmeta.server`` / ``fedmeta.client`` -- the Flower ServerApp and ClientApp and the round logic;
* ``fedmeta.simulation`` -- ``fedmeta simulate``, server and client in one process;
* ``fedmeta.cli`` -- the command line;
* ``fedmeta`` itself -- the shared floor: configuration, wire protocol, workload, checkpoints,
  paths, exit codes.
"""

__version__ = "0.1.0"
