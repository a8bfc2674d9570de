"""spec.requestLimits of a TrustClass on a real kube-apiserver: bounds enforced by the CRD's schema,
naming the field; a valid value stored as given and read by the operator's model."""

from __future__ import annotations

from typing import Any

import pytest
from cluster.manifests import trust_class

from kvfence.api.trustclass import TrustClass


@pytest.mark.parametrize(
    ("limits", "field"),
    [
        ({"maxN": 0}, "spec.requestLimits.maxN"),
        ({"maxPromptsPerRequest": 5000}, "spec.requestLimits.maxPromptsPerRequest"),
        ({"maxGrammarBytes": -1}, "spec.requestLimits.maxGrammarBytes"),
        ({"maxStopSequences": "many"}, "spec.requestLimits.maxStopSequences"),
    ],
)
def test_out_of_bounds_request_limits_are_refused_naming_the_field(
    installed: Any, kv: Any, limits: dict[str, Any], field: str
) -> None:
    res = kv.apply(trust_class("crd-limits-bad", requestLimits=limits))
    assert res.returncode != 0, f"accepted: {limits}"
    assert field in res.stderr, res.stderr
    assert kv.json("get", "trustclass", "crd-limits-bad") is None


def test_request_limits_are_stored_as_given(installed: Any, kv: Any) -> None:
    limits = {"maxPromptsPerRequest": 300, "maxN": 4, "maxSequencesPerRequest": 1200}
    res = kv.apply(trust_class("crd-limits", requestLimits=limits))
    assert res.returncode == 0, res.stderr
    try:
        stored = kv.json("get", "trustclass", "crd-limits")
        assert stored["spec"]["requestLimits"] == limits  # nothing defaulted into the object
        route = TrustClass.model_validate(stored).spec.request_limits
        assert route is not None
        got = route.route()
        assert got is not None and got.max_n == 4 and got.max_stop_sequences == 16
    finally:
        kv("delete", "trustclass", "crd-limits", "--wait=false")
