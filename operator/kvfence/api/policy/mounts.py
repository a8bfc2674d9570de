"""Where ``engine.extraVolumeMounts`` may mount, and which volume names are kvfence's own."""

from __future__ import annotations

#: The only places ``engine.extraVolumeMounts`` may mount at (the mount point itself or below it):
#: nothing of the engine images, the operator's own mounts (config, signing keys, /tmp, /dev/shm, the
#: model cache) or the system lives there, so an extra mount can neither shadow code the isolation
#: relies on nor the files the operator gives the engine.
EXTRA_MOUNT_ROOTS: tuple[str, ...] = ("/adapters", "/models", "/mnt", "/data")
EXTRA_MOUNT_PATTERN = (
    "^/(" + "|".join(r.removeprefix("/") for r in EXTRA_MOUNT_ROOTS) + r")(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*$"
)
#: Names of the operator's own volumes in the engine pod (``engine.extraVolumes`` may not take them).
RESERVED_VOLUMES: tuple[str, ...] = ("config", "signing-key", "tmp", "cache", "dshm")


def under(path: str, root: str) -> bool:
    """``path`` is ``root`` or lies below it."""
    return path == root or path.startswith(root.rstrip("/") + "/")
