"""Pure logic the operator, the trainer, the node agents and the simulator share: layout
planning, the power policy, the power -> speed model and goodput accounting. No I/O."""
