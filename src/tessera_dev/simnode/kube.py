"""The node's calls to the API server, as plain dicts, under the node's own identity.

The kubeconfig's client certificate is system:node:NAME in system:nodes, so the Node authorizer
and NodeRestriction admission bound it as they bound a real kubelet: its Node and Lease, the pods
bound to it and the objects those pods reference (ConfigMaps, Secrets, service accounts, and the
PersistentVolumeClaims and the PersistentVolumes bound to them).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tessera_kube import clients

LEASE_NAMESPACE = "kube-node-lease"
MERGE_PATCH = "application/merge-patch+json"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _json(response: Any) -> dict[str, Any]:
    return json.loads(response.data)


class NodeApi:
    """One API client for the node process (the client's connection pool is thread-safe)."""

    def __init__(self, kubeconfig: str, timeout: float = 10.0) -> None:
        self.client = clients.api_client(kubeconfig)
        self.core = client.CoreV1Api(self.client)
        self.coordination = client.CoordinationV1Api(self.client)
        self.resource = client.ResourceV1Api(self.client)
        self.timeout = timeout

    @property
    def server(self) -> tuple[str, int]:
        """The API server's host and port, for KUBERNETES_SERVICE_HOST/PORT."""
        url = urlsplit(self.client.configuration.host)
        return url.hostname or "127.0.0.1", url.port or 443

    def server_version(self) -> str:
        return client.VersionApi(self.client).get_code(
            _request_timeout=self.timeout).git_version

    # -- the Node and its Lease

    def register_node(self, node: dict[str, Any]) -> None:
        """Create the Node, or patch its labels onto the existing one; then set its status."""
        name = node["metadata"]["name"]
        try:
            self.core.create_node(node, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self.core.patch_node(name, {"metadata": {"labels": node["metadata"]["labels"]}},
                                 _request_timeout=self.timeout)
        self.patch_node_status(name, node["status"])

    def patch_node_status(self, name: str, status: Mapping[str, Any]) -> None:
        # strategic merge: conditions merge by type, so other writers' conditions stay
        self.core.patch_node_status(name, {"status": status}, _request_timeout=self.timeout)

    def renew_lease(self, node: str, node_uid: str, duration_s: int) -> None:
        """Create or renew the node's Lease in kube-node-lease (owned by the Node, as kubelet's)."""
        spec = {"holderIdentity": node, "leaseDurationSeconds": duration_s,
                "renewTime": now_micro()}
        try:
            lease = _json(self.coordination.read_namespaced_lease(
                node, LEASE_NAMESPACE, _preload_content=False, _request_timeout=self.timeout))
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.coordination.create_namespaced_lease(LEASE_NAMESPACE, {
                "metadata": {"name": node, "namespace": LEASE_NAMESPACE, "ownerReferences": [{
                    "apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}]},
                "spec": spec}, _request_timeout=self.timeout)
            return
        lease["spec"].update(spec)
        self.coordination.replace_namespaced_lease(node, LEASE_NAMESPACE, lease,
                                                   _request_timeout=self.timeout)

    def node_uid(self, name: str) -> str:
        return _json(self.core.read_node(name, _preload_content=False,
                                         _request_timeout=self.timeout))["metadata"]["uid"]

    # -- pods

    def patch_pod_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        # a JSON merge patch replaces lists whole: the node owns containerStatuses and conditions
        self.core.patch_namespaced_pod_status(name, namespace, {"status": status},
                                              _content_type=MERGE_PATCH,
                                              _request_timeout=self.timeout)

    def record_event(self, pod: Mapping[str, Any], node: str, kind: str, reason: str,
                     message: str, container: str | None = None) -> None:
        """An Event about the pod (or one of its containers) from this node's kubelet."""
        meta, now = pod["metadata"], now_rfc3339()
        involved = {"apiVersion": "v1", "kind": "Pod", "namespace": meta["namespace"],
                    "name": meta["name"], "uid": meta["uid"]}
        if container is not None:
            involved["fieldPath"] = f"spec.containers{{{container}}}"
        self.core.create_namespaced_event(meta["namespace"], {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": involved, "type": kind, "reason": reason, "message": message,
            "source": {"component": "kubelet", "host": node}, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "reportingComponent": "kubelet", "reportingInstance": node,
        }, _request_timeout=self.timeout)

    def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        """Remove a pod whose containers are gone (grace 0, only this incarnation of it)."""
        try:
            self.core.delete_namespaced_pod(
                name, namespace, body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
                _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def may_proxy(self, node: str, user: str, groups: list[str]) -> bool:
        """Whether user may `get nodes/proxy` of this node: the kubelet API's authorization."""
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
                  "spec": {"user": user, "groups": groups, "resourceAttributes": {
                      "verb": "get", "resource": "nodes", "subresource": "proxy",
                      "name": node}}}
        answer = _json(client.AuthorizationV1Api(self.client).create_subject_access_review(
            review, _preload_content=False, _request_timeout=self.timeout))
        return bool(answer["status"].get("allowed"))

    # -- dynamic resource allocation (the node's DRA driver)

    def publish_slice(self, body: dict[str, Any]) -> int:
        """Create the node's ResourceSlice, or replace the one there at its next pool
        generation; returns the generation published. The Node authorizer lets a node create
        a slice of its own and then read and write it by name (not apply it: apply reads
        first), and list slices only by spec.nodeName."""
        name = body["metadata"]["name"]
        try:
            self.resource.create_resource_slice(body, _request_timeout=self.timeout)
            return body["spec"]["pool"]["generation"]
        except ApiException as exc:
            if exc.status != 409:
                raise
        current = _json(self.resource.read_resource_slice(
            name, _preload_content=False, _request_timeout=self.timeout))
        body = {**body, "metadata": {**body["metadata"],
                                     "resourceVersion": current["metadata"]["resourceVersion"]}}
        generation = current["spec"]["pool"]["generation"] + 1
        body["spec"] = {**body["spec"], "pool": {**body["spec"]["pool"],
                                                 "generation": generation}}
        self.resource.replace_resource_slice(name, body, _request_timeout=self.timeout)
        return generation

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A ResourceClaim a pod bound here references, or None when it does not exist."""
        try:
            return _json(self.resource.read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=self.timeout))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- what pods reference

    def read_object(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None:
        """A ConfigMap's or Secret's data as bytes, or None when it does not exist."""
        read = {"configmap": self.core.read_namespaced_config_map,
                "secret": self.core.read_namespaced_secret}[kind]
        try:
            obj = _json(read(name, namespace, _preload_content=False,
                             _request_timeout=self.timeout))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        if kind == "secret":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    def read_storage(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A PersistentVolumeClaim ("persistentvolumeclaim", in namespace) or PersistentVolume
        ("persistentvolume"; namespace unused), or None when it does not exist."""
        options = {"_preload_content": False, "_request_timeout": self.timeout}
        read = {"persistentvolumeclaim": lambda: self.core.read_namespaced_persistent_volume_claim(
                    name, namespace, **options),
                "persistentvolume": lambda: self.core.read_persistent_volume(name, **options)}[kind]
        try:
            return _json(read())
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def request_token(self, pod: Mapping[str, Any], account: str, audience: str | None,
                      seconds: int) -> tuple[str, float]:
        """A TokenRequest token bound to the pod; returns it and its lifetime in seconds."""
        meta = pod["metadata"]
        spec: dict[str, Any] = {
            "expirationSeconds": seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "uid": meta["uid"]}}
        if audience:
            spec["audiences"] = [audience]
        answer = _json(self.core.create_namespaced_service_account_token(
            account, meta["namespace"], {"spec": spec}, _preload_content=False,
            _request_timeout=self.timeout))
        expires = datetime.fromisoformat(answer["status"]["expirationTimestamp"])
        return answer["status"]["token"], (expires - datetime.now(UTC)).total_seconds()
