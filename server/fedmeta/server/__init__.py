"""The trusted fedmeta server: round logic, reply validation, noise, checkpoints, the ServerApp."""
