"""The pydantic models against the same refused specs as the CRDs' rules (pure: no cluster), and every
CEL rule of the generated CRDs tripped by one of those specs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from cluster.cel_cases import ALL_CASES, Case
from pydantic import ValidationError

from kvfence.api.tenantbinding import TenantBinding
from kvfence.api.trustclass import TrustClass

ROOT = Path(__file__).resolve().parents[2]

#: Rules with generated tests of their own, over the whole policy table (test_operator_crds.py).
OWN_TESTS = {".spec.engine.extraArgs", ".spec.engine.extraArgs[]", ".spec.engine.extraEnv[].name"}
_STATUS_PREFIX = re.compile(r"^(Forbidden|Required value|Invalid value): ")


class Rule(NamedTuple):
    kind: str
    path: str  # where the API server reports it: the schema path, then the rule's fieldPath
    rule: str
    message: str | None  # None where the rule writes its message with a messageExpression


def _walk(kind: str, node: Any, path: str, out: list[Rule]) -> None:
    if not isinstance(node, dict):
        return
    for r in node.get("x-kubernetes-validations") or []:
        out.append(Rule(kind, path + r.get("fieldPath", ""), r["rule"], r.get("message")))
    for name, child in (node.get("properties") or {}).items():
        _walk(kind, child, f"{path}.{name}", out)
    _walk(kind, node.get("items"), path + "[]", out)
    if isinstance(node.get("additionalProperties"), dict):
        _walk(kind, node["additionalProperties"], path + "{}", out)


def crd_rules() -> list[Rule]:
    """Every x-kubernetes-validations rule of the generated CRDs."""
    out: list[Rule] = []
    for f in sorted((ROOT / "crds").glob("*.yaml")):
        crd = yaml.safe_load(f.read_text())
        for version in crd["spec"]["versions"]:
            _walk(crd["spec"]["names"]["kind"], version["schema"]["openAPIV3Schema"], "", out)
    return out


def needs_more_than_a_spec(rule: Rule) -> bool:
    """A transition rule compares an update with the stored object, and a rule on metadata reads no
    spec: test_operator_crds.py checks those on the API server (the name's length, the immutable
    namespace and tenantId)."""
    return "oldSelf" in rule.rule or rule.rule.startswith("self.metadata")


def _schema_path(field: str) -> str:
    """``spec.a[0].b`` as the schema path ``.spec.a[].b``."""
    return "." + re.sub(r"\[\d+\]", "[]", field)


def trips(case: Case, rule: Rule) -> bool:
    """Whether the API server's refusal of ``case`` is this rule's: same field, and its words are in the
    rule's message (a rule with a messageExpression is told by its field alone)."""
    if case.kind != rule.kind or _schema_path(case.field) != rule.path:
        return False
    return rule.message is None or _STATUS_PREFIX.sub("", case.words) in rule.message


def _validate(case: Case) -> None:
    body = case.manifest()
    model = TrustClass if case.kind == "TrustClass" else TenantBinding
    model.model_validate({"metadata": body["metadata"], "spec": body["spec"]})


def _location(err: dict[str, Any]) -> str:
    path = ""
    for part in err["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path.lstrip(".")


@pytest.mark.parametrize("case", ALL_CASES, ids=Case.id)
def test_the_model_refuses_what_the_crd_refuses_naming_the_field(case: Case) -> None:
    """Each error's location is the field the API server names, or a field above it (a check on
    several fields of one object reports at that object)."""
    if case.model_accepts:
        _validate(case)  # where this starts to fail, the model checks the rule: drop model_accepts
        return
    with pytest.raises(ValidationError) as e:
        _validate(case)
    located = [_location(err) for err in e.value.errors()]
    assert any(case.field == loc or case.field.startswith(loc + ".") or case.field.startswith(loc + "[")
               for loc in located), (case.field, located, str(e.value))  # fmt: skip


def test_every_cel_rule_of_the_crds_is_tripped_by_a_shared_case() -> None:
    rules = crd_rules()
    assert len(rules) > 30, rules  # the walk found the CRDs' rules
    assert {r.path for r in rules} >= OWN_TESTS, OWN_TESTS
    checked = [r for r in rules if r.path not in OWN_TESTS and not needs_more_than_a_spec(r)]
    # the name's length, the immutable namespace and the immutable tenantId
    assert len(rules) - len(checked) == len(OWN_TESTS) + 3, [r for r in rules if r not in checked]
    uncovered = [r for r in checked if not any(trips(c, r) for c in ALL_CASES)]
    assert not uncovered, (
        "no case trips these CEL rules: add a case to tests/cluster/cel_cases.py\n"
        + "\n".join(f"  {r.kind} {r.path}: {r.message or r.rule}" for r in uncovered)
    )


def test_a_rule_without_a_message_is_alone_at_its_field() -> None:
    """Rules with a messageExpression are told apart by their field only."""
    rules = crd_rules()
    for r in rules:
        if r.message is None:
            assert [o for o in rules if (o.kind, o.path) == (r.kind, r.path)] == [r], r
