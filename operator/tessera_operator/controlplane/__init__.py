"""A real local Kubernetes control plane (etcd + kube-apiserver) built from the Go module registry."""
