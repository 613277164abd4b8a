"""Keys and certificates for the local control plane, made with the openssl command line tool.

One self-signed CA signs the apiserver's serving certificate, an admin client certificate in
group system:masters and one client certificate per other identity of the cluster (scheduler,
controller-manager, each simulated node, the apiserver's own client to the kubelets); a separate
key pair signs service-account tokens (TokenRequest).
EC P-256 keys keep generation well under a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ADMIN_USER = "tessera-admin"


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path
    kubelet_client_cert: Path
    kubelet_client_key: Path

    @classmethod
    def at(cls, root: Path) -> Pki:
        return cls(*(root / name for name in (
            "ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "admin.crt", "admin.key",
            "sa.key", "sa.pub", "apiserver-kubelet-client.crt", "apiserver-kubelet-client.key",
        )))


def write_secret(path: Path, data: bytes) -> Path:
    """Write a file only its owner can read, from the moment it exists (no umask window)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that already existed
        file.write(data)
    return path


def _openssl(*args: str | Path) -> bytes:
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command is required (Debian package `openssl`)")
    return subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True).stdout


def _key(path: Path) -> None:
    # the key comes back on stdout, so openssl never creates the file with a looser mode
    write_secret(path, _openssl("genpkey", "-algorithm", "EC", "-pkeyopt",
                                "ec_paramgen_curve:P-256"))


def _signed(pki: Pki, key: Path, cert: Path, subject: str, *extensions: str) -> None:
    _key(key)
    # without an explicit CA:FALSE openssl copies the CA extensions of its default config
    addext = [
        arg for ext in ("basicConstraints=critical,CA:FALSE", *extensions)
        for arg in ("-addext", ext)
    ]
    _openssl("req", "-new", "-key", key, "-subj", subject, "-CA", pki.ca_cert, "-CAkey",
             pki.ca_key, "-days", "3650", *addext, "-out", cert)


def generate(root: Path) -> Pki:
    """Write a fresh CA, serving and admin certificates and a token signing key pair under root."""
    root.mkdir(parents=True, exist_ok=True)
    pki = Pki.at(root)
    # 1. the CA that every client of the apiserver trusts, and that the apiserver trusts back
    _key(pki.ca_key)
    _openssl("req", "-x509", "-new", "-key", pki.ca_key, "-subj", "/CN=tessera-local-ca",
             "-days", "3650", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-out", pki.ca_cert)
    # 2. the serving certificate, valid for the loopback names clients dial
    _signed(pki, pki.serving_key, pki.serving_cert, "/CN=kube-apiserver",
            "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc",
            "extendedKeyUsage=serverAuth")
    # 3. the admin client certificate: O=system:masters is bound to cluster-admin by RBAC
    _signed(pki, pki.admin_key, pki.admin_cert, f"/O=system:masters/CN={ADMIN_USER}",
            "extendedKeyUsage=clientAuth")
    # 4. the service-account token signing pair
    _key(pki.sa_key)
    _openssl("pkey", "-in", pki.sa_key, "-pubout", "-out", pki.sa_pub)
    # 5. the apiserver's client certificate towards the nodes' kubelet endpoints (logs)
    _signed(pki, pki.kubelet_client_key, pki.kubelet_client_cert,
            "/O=system:masters/CN=kube-apiserver-kubelet-client", "extendedKeyUsage=clientAuth")
    return pki


def client_certificate(pki: Pki, root: Path, name: str, user: str,
                       groups: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A client certificate for `user` in `groups` (CN and O, as the apiserver reads them),
    written as root/name.crt and root/name.key; returns (cert, key)."""
    cert, key = root / f"{name}.crt", root / f"{name}.key"
    subject = "".join(f"/O={g}" for g in groups) + f"/CN={user}"
    _signed(pki, key, cert, subject, "extendedKeyUsage=clientAuth")
    return cert, key


def serving_certificate(pki: Pki, root: Path, name: str, ips: tuple[str, ...]) -> tuple[Path, Path]:
    """A serving certificate for the given IP addresses (a simulated node's kubelet endpoint)."""
    cert, key = root / f"{name}.crt", root / f"{name}.key"
    alt = ",".join(f"IP:{ip}" for ip in ips)
    _signed(pki, key, cert, f"/CN={name}", f"subjectAltName={alt}",
            "extendedKeyUsage=serverAuth")
    return cert, key
