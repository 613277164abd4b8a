"""The entrypoints of this project's container images, and the stand-ins for the third-party
images the local cluster runs: the node runs them without pulling."""

from __future__ import annotations

# image repository (last path segment, without tag or digest) -> ENTRYPOINT of its Dockerfile
# target; an image's CMD is empty for all of them, so a container's args follow the entrypoint
ENTRYPOINTS: dict[str, tuple[str, ...]] = {
    "tessera": ("tessera",),
    "tessera-power-agent": ("tessera", "power-agent"),
    "tessera-trainer": ("python", "-m", "ntp.nodeagent"),
}

# third-party image repository -> what a simulated node runs in its place
STAND_INS: dict[str, tuple[str, ...]] = {
    "dcgm-exporter": ("python", "-m", "tessera_dev.simnode.exporter"),
}


def repository(image: str) -> str:
    """The image's repository name: `ghcr.io/org/tessera:0.1@sha256:...` -> `tessera`."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def entrypoint(image: str) -> tuple[str, ...] | None:
    """The image's ENTRYPOINT (or its stand-in's), or None for an image the node cannot run."""
    name = repository(image)
    return ENTRYPOINTS.get(name) or STAND_INS.get(name)
