"""The Kubernetes names every process agrees on: API group, kinds, labels, annotations, field
managers, and the CRDs themselves (package data, so an installed wheel carries them)."""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import yaml

GROUP = "tessera.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

JOB_KIND, JOB_PLURAL = "NTPTrainingJob", "ntptrainingjobs"
POWER_TARGET_KIND, POWER_TARGET_PLURAL = "GPUPowerTarget", "gpupowertargets"
GPU_HEALTH_KIND, GPU_HEALTH_PLURAL = "GPUHealth", "gpuhealths"

# on every child of a job: which job (its name) and which part (trainer or rendezvous)
JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
# on a job's pods and the ConfigMaps its trainers read and write: the attempt they belong to
# (a restart or a resume starts the next one, in the job's status.attempt)
ATTEMPT_LABEL = f"{GROUP}/attempt"
# on a GPUPowerTarget: the UID of the job it serves. Targets are cluster-scoped and jobs
# namespaced, and a cluster-scoped object cannot be owned by a namespaced one (the garbage
# collector never resolves such an ownerReference): the owning job is named by its UID instead.
JOB_UID_LABEL = f"{GROUP}/job-uid"
# on a trainer pod: a digest of each spec field it was made from, to say which edits it lacks
INPUTS_ANNOTATION = f"{GROUP}/pod-inputs"
# spec.managedBy of the jobs Tessera's operator reconciles (also when it is absent)
JOB_MANAGER = f"{GROUP}/operator"
# on a Node: the indices of its GPUs that a person took out of service (`tessera cordon-gpu`)
CORDON_ANNOTATION = f"{GROUP}/cordoned-gpus"

# the operator's Deployment in the install's namespace, its pods' app.kubernetes.io/name, and
# the Lease its replicas elect a leader on
OPERATOR_NAME = "tessera-operator"

# server-side apply field managers, one per writer, so each owns only its own fields
OPERATOR_MANAGER = "tessera-operator"
HEALTH_AGENT_MANAGER = "tessera-health-agent"

CRD_FILES = ("ntptrainingjob.yaml", "gpupowertarget.yaml", "gpuhealth.yaml")


def crd_documents() -> list[dict[str, Any]]:
    """The CustomResourceDefinitions Tessera serves, read from this package's data."""
    return [yaml.safe_load(text) for text in _crd_texts()]


@cache  # read once per process: the operator parses every job's spec against the schema
def _crd_texts() -> tuple[str, ...]:
    folder = resources.files("tessera_contracts") / "crds"
    return tuple((folder / name).read_text() for name in CRD_FILES)


@cache
def job_schema() -> dict[str, Any]:
    """The NTPTrainingJob's `spec` schema (openAPIV3Schema), as the API server validates it;
    one object per process, not to be changed."""
    crd = crd_documents()[0]
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
