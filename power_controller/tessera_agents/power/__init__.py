"""The node power agent: GPU power limits within the device's range and the rack budget."""
