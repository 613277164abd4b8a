"""Kueue on the local cluster (`tessera-dev up --kueue`): its release manifests, rendered offline
from its module (build.py), installed with its webhooks reached by URL on loopback, and its
controller run as a local process beside the control plane's own components.

A local process is reached by no Service (the apiserver refuses loopback addresses in
EndpointSlices, and there is no kube-proxy), so every webhook and CRD conversion webhook of the
release becomes `url: https://127.0.0.1:PORT/<its path>` with the cluster CA as caBundle, and
the controller serves them with a certificate that CA signs (Kueue's internal certificate
management off: it would rewrite the caBundles). With it off, Kueue reads its metrics certificate
from the fixed path /etc/kueue/metrics/certs: the process runs in a mount namespace of its own
whose /etc is an overlay holding them, and the host's /etc is left untouched.

Kueue manages only the namespaces labelled MANAGED_LABEL=true (`managedJobsNamespaceSelector`),
and its workload webhooks are narrowed to them: with failurePolicy Fail, a webhook of a stopped
Kueue would refuse every pod of the cluster. NTPTrainingJob is registered as an external
framework, so that Kueue's pod integration leaves the pods of a queued job alone; Kueue may read
the jobs (manifests/kueue). Claims of DeviceClass gpu.nvidia.com count against `nvidia.com/gpu`
quota (`resources.deviceClassMappings`).
"""

from __future__ import annotations

import base64
import copy
import shutil
import ssl
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_contracts.api import GROUP, JOB_KIND, VERSION
from tessera_dev import paths, probes, processes
from tessera_dev.controlplane import crds, launcher, manifests, pki

NAMESPACE = "kueue-system"
SERVICE_ACCOUNT = "kueue-controller-manager"
# the namespaces Kueue manages on the local cluster
MANAGED_LABEL = "kueue.tessera.dev/managed"
EXTERNAL_FRAMEWORK = f"{JOB_KIND}.{VERSION}.{GROUP}"
# GPUs asked for by DRA claims of this class count as this extended resource in quotas
GPU_RESOURCE, GPU_DEVICE_CLASS = "nvidia.com/gpu", "gpu.nvidia.com"
# what Tessera grants Kueue (docs/install.md, Kueue)
TESSERA_RBAC = paths.repo_root() / "manifests" / "kueue" / "ntptrainingjob-reader.yaml"
# the release's objects a local process has no use for: its Deployment and the Services,
# ConfigMap and Secret the Deployment would use; the visibility API's APIServices (one whose
# Service nothing reaches breaks discovery, and with it namespace deletion) and their RoleBinding
DROPPED_KINDS = {"Deployment", "Service", "ConfigMap", "Secret", "APIService"}
WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
# the release's names for them
WEBHOOK_CONFIGURATIONS = ("kueue-mutating-webhook-configuration",
                          "kueue-validating-webhook-configuration")
METRICS_CERTS = Path("kueue/metrics/certs")  # under /etc, read by Kueue whatever its config says
READY_TIMEOUT_S = 120.0
STATE_DIR = "kueue"


def local_objects(release: Iterable[dict[str, Any]], url: str,
                  ca_bundle: bytes) -> list[dict[str, Any]]:
    """The release's objects for a controller served at `url`: dropped what a local process has
    no use for, every webhook and conversion webhook called at `url` + its path and trusting
    `ca_bundle` (PEM), the workload webhooks narrowed to the managed namespaces."""
    ca = base64.b64encode(ca_bundle).decode()
    kept = []
    for original in release:
        obj = copy.deepcopy(original)
        kind, meta = obj["kind"], obj["metadata"]
        if kind in DROPPED_KINDS or (kind == "RoleBinding" and meta.get("namespace") !=
                                     NAMESPACE):
            continue
        if kind == "CustomResourceDefinition":
            conversion = obj["spec"].get("conversion") or {}
            if conversion.get("strategy") == "Webhook":
                _to_url(conversion["webhook"]["clientConfig"], url, ca)
        if kind in WEBHOOK_KINDS:
            for webhook in obj["webhooks"]:
                _to_url(webhook["clientConfig"], url, ca)
                # the workload kinds' webhooks select namespaces; Kueue's own kinds' do not
                if "namespaceSelector" in webhook:
                    webhook["namespaceSelector"] = {"matchLabels": {MANAGED_LABEL: "true"}}
        kept.append(obj)
    return kept


def _to_url(client_config: dict[str, Any], url: str, ca: str) -> None:
    service = client_config.pop("service")
    client_config["url"] = url + service.get("path", "/")
    client_config["caBundle"] = ca


def configuration(webhook_port: int, health_port: int, metrics_port: int,
                  cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration (config.kueue.x-k8s.io/v1beta2) for the local process."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        # its APIService would name a Service nothing reaches here
        "featureGates": {"VisibilityOnDemand": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": {MANAGED_LABEL: "true"}},
        "integrations": {"frameworks": ["batch/job", "pod"],
                         "externalFrameworks": [EXTERNAL_FRAMEWORK]},
        "resources": {"deviceClassMappings": [
            {"name": GPU_RESOURCE, "deviceClassNames": [GPU_DEVICE_CLASS]}]},
    }


def _served(port: int, ca: Path) -> bool:
    """Whether the webhook server answers TLS on `port` with a certificate `ca` signed."""
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with ssl.create_connection(("127.0.0.1", port), timeout=2) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1"):
            return True
    except OSError:
        return False


def config_path(data_dir: Path) -> Path:
    """Where the controller of the control plane in `data_dir` reads its Configuration."""
    return data_dir / STATE_DIR / "config.yaml"


@dataclass
class Kueue:
    """Kueue's controller, a local process of the control plane in `data_dir`."""

    pid: int
    data_dir: Path
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @classmethod
    def start(cls, plane: launcher.ControlPlane, binary: Path, release: Path, *,
              detached: bool = False) -> Kueue:
        """Install the release's objects, start the controller and wait until it serves its
        webhooks, then register them. Detached, it outlives this process (`tessera-dev up`)."""
        root = plane.data_dir / STATE_DIR
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        # 1. a serving certificate for the loopback address, from the CA the apiserver trusts
        keys = plane.keys
        cert, key = pki.serving_certificate(keys, root, "kueue-webhook", ("127.0.0.1",))
        certs, overlay = root / "certs", root / "etc"
        for folder in (certs, overlay / "upper" / METRICS_CERTS):
            folder.mkdir(parents=True)
            shutil.copy2(cert, folder / "tls.crt")
            shutil.copy2(key, folder / "tls.key")
        (overlay / "work").mkdir()
        webhook_port, health_port, metrics_port = processes.free_ports(3)
        objects = local_objects(
            (doc for doc in yaml.safe_load_all(release.read_text()) if doc),
            f"https://127.0.0.1:{webhook_port}", keys.ca_cert.read_bytes())
        webhooks = [obj for obj in objects if obj["kind"] in WEBHOOK_KINDS]
        with plane.api_client() as api:
            # 2. its CRDs (served once Established), then its namespace, identity and RBAC, and
            #    what it may read of Tessera's
            crds.apply(api, [obj for obj in objects
                             if obj["kind"] == "CustomResourceDefinition"],
                       timeout=READY_TIMEOUT_S)
            manifests.apply_documents(api, [
                obj for obj in objects
                if obj["kind"] not in (*WEBHOOK_KINDS, "CustomResourceDefinition")])
            manifests.apply(api, [TESSERA_RBAC])
            # 3. the controller, under its service account's name
            kubeconfig = plane.identity_kubeconfig(
                "kueue", f"system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}",
                ("system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}"))
            config = config_path(plane.data_dir)
            config.write_text(yaml.safe_dump(configuration(
                webhook_port, health_port, metrics_port, certs), sort_keys=False))
            log = root / "kueue.log"
            mount = (f"mount -t overlay overlay -o lowerdir=/etc,upperdir={overlay / 'upper'},"
                     f"workdir={overlay / 'work'} /etc")
            proc = processes.spawn(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f'{mount} && exec "$0" "$@"', str(binary), f"--config={config}",
                 f"--kubeconfig={kubeconfig}", "--zap-log-level=2"],
                log, die_with_parent=not detached)
            running = cls(proc.pid, plane.data_dir, proc)
            try:
                # 4. ready, and serving the webhooks; only then registered, so that no object
                #    is refused for want of a server
                processes.wait_until(
                    lambda: probes.responds(f"http://127.0.0.1:{health_port}/readyz")
                    and _served(webhook_port, keys.ca_cert), what="kueue", proc=proc,
                    log_path=log, timeout=READY_TIMEOUT_S)
                manifests.apply_documents(api, webhooks)
            except BaseException:
                running.stop(api)
                raise
        return running

    def stop(self, api: client.ApiClient | None = None) -> None:
        """Unregister its webhooks (with `api`: a cluster that lives on must not call webhooks
        nobody serves), then stop the controller."""
        if api is not None:
            admission = client.AdmissionregistrationV1Api(api)
            mutating, validating = WEBHOOK_CONFIGURATIONS
            for delete, name in ((admission.delete_mutating_webhook_configuration, mutating),
                                 (admission.delete_validating_webhook_configuration, validating)):
                try:
                    delete(name, _request_timeout=10)
                except ApiException as exc:
                    if exc.status != 404:
                        raise
        if self._proc is not None:
            processes.stop_group(self._proc)
        elif self.is_running():
            processes.stop_group(self.pid)

    def is_running(self) -> bool:
        """Whether its pid still runs this control plane's Kueue (not reused since)."""
        return processes.runs_command(self.pid, f"--config={config_path(self.data_dir)}")
