"""What the processes share to reach Kubernetes and outlive faults: an API client from a kubeconfig
or the pod's identity (`clients`), a bounded list-then-watch of a selection of objects
(`listwatch`), files written whole or not at all (`files`) and children that die with their
parent (`lifetime`). Below every process package; the pure layers never import it."""
