"""The fedmeta participant: a Flower ClientApp that returns clipped per-task MAML query gradients."""
