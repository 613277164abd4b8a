"""A real local Kubernetes control plane: etcd + kube-apiserver built from Go modules."""
