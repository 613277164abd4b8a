"""Development tooling (`tessera-dev`): the local GPU cluster, simulated nodes, the demo and the
benches."""
