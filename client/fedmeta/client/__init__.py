"""The fedmeta participant: a Flower ClientApp returning clipped per-task MAML query gradients."""
