"""The simulation harness: the server and client apps wired together on one machine."""
