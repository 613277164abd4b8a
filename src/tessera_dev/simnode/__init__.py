"""Simulated GPU nodes: a kubelet-like process that runs a node's pods as local processes."""
