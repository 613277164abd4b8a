"""The user's `tessera` command: run the operator or a node agent, cordon and uncordon GPUs."""
