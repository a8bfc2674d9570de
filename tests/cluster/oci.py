"""Write OCI image archives without a registry or a container engine.

A layer is a tar of files; the archive is the OCI image layout (``oci-layout``, ``index.json`` and
content-addressed blobs) that ``ctr images import`` and ``podman load`` read. Used for the pause image
the real node's sandboxes need, which is one static binary.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Layer:
    """Files for one layer: path in the image -> (bytes, mode)."""

    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)

    def add(self, path: str, data: bytes, mode: int = 0o644) -> Layer:
        self.files[path.lstrip("/")] = (data, mode)
        return self

    def tar(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            dirs: set[str] = set()
            for path in sorted(self.files):
                parts = path.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    d = "/".join(parts[:i])
                    if d not in dirs:
                        dirs.add(d)
                        info = tarfile.TarInfo(d)
                        info.type = tarfile.DIRTYPE
                        info.mode = 0o755
                        tf.addfile(info)
                data, mode = self.files[path]
                info = tarfile.TarInfo(path)
                info.size = len(data)
                info.mode = mode
                tf.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"digest": digest, "size": len(data)}


def write_archive(
    out: Path,
    name: str,
    layers: Sequence[Layer],
    *,
    entrypoint: Sequence[str] = (),
    cmd: Sequence[str] = (),
    env: Sequence[str] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",),
    user: str = "",
    workdir: str = "",
    labels: Mapping[str, str] | None = None,
) -> Path:
    """Write ``name`` (e.g. ``registry.k8s.io/pause:3.10``) as an OCI archive at ``out``."""
    blobs: dict[str, bytes] = {}
    layer_descs, diff_ids = [], []
    for layer in layers:
        raw = layer.tar()
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        gz = gzip.compress(raw, mtime=0)
        layer_descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **_blob(blobs, gz)})
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": list(entrypoint) or None,
            "Cmd": list(cmd) or None,
            "Env": list(env),
            "User": user,
            "WorkingDir": workdir,
            "Labels": dict(labels or {}),
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created_by": "kvfence tests/cluster/oci.py"}],
    }
    config_desc = _blob(blobs, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_desc},
        "layers": layer_descs,
    }
    manifest_desc = _blob(blobs, json.dumps(manifest, sort_keys=True).encode())
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                **manifest_desc,
                "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tf:

        def add(path: str, data: bytes) -> None:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))

        add("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        add("index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            add(f"blobs/sha256/{digest.split(':', 1)[1]}", data)
    return out
