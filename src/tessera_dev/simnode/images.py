"""The entrypoints of this project's container images: the node runs them without pulling."""

from __future__ import annotations

# image repository (last path segment, without tag or digest) -> ENTRYPOINT of its Dockerfile
# target; an image's CMD is empty for all of them, so a container's args follow the entrypoint
ENTRYPOINTS: dict[str, tuple[str, ...]] = {
    "tessera": ("tessera",),
    "tessera-power-agent": ("tessera", "power-agent"),
    "tessera-trainer": ("python", "-m", "ntp.nodeagent"),
}


def repository(image: str) -> str:
    """The image's repository name: `ghcr.io/org/tessera:0.1@sha256:...` -> `tessera`."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def entrypoint(image: str) -> tuple[str, ...] | None:
    """The image's ENTRYPOINT, or None for an image this project does not build."""
    return ENTRYPOINTS.get(repository(image))
