"""The node health agent: this node's dcgm-exporter page -> its GPUHealth object."""
