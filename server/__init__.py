"""The trusted fedmeta server: round logic, reply validation, noise, checkpoints and the Flower ServerApp."""
