"""Kubernetes Events about the custom resources: what the reconciler tells (:class:`Event`) and how it
is posted (:class:`EventRecorder`)."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

from kvfence.operator.apply import Kube
from kvfence.operator.builders import FIELD_MANAGER

log = logging.getLogger("kvfence.operator")


@dataclass
class Event:
    obj: dict[str, Any]
    reason: str
    message: str
    type: str = "Normal"


class EventRecorder:
    """Posts core/v1 Events about the custom resources (best effort: a failure is only logged)."""

    def __init__(self, kube: Kube, instance: str) -> None:
        self.kube, self.instance = kube, instance

    def __call__(self, ev: Event) -> None:
        meta = ev.obj.get("metadata", {})
        ns = meta.get("namespace") or "default"
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'kvfence')}.", "namespace": ns},
            "involvedObject": {
                "apiVersion": ev.obj.get("apiVersion"),
                "kind": ev.obj.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": ev.reason,
            "message": ev.message[:1024],
            "type": ev.type,
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": f"kvfence.dev/{FIELD_MANAGER}",
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.kube.create(body)
        except Exception as e:
            log.warning("could not post event %s: %s", ev.reason, e)
