"""The node agents: the power agent (GPU power limits), the health agent (GPU health from
DCGM)."""
