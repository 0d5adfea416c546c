"""The Kubernetes manifests in deploy/kuberay, checked against the schemas, offline.

* Kubernetes' own objects (Service, NetworkPolicy) and every pod template inside the
  RayCluster, against Kubernetes' OpenAPI schemas as the ``kubernetes-validate`` package
  ships them (strict: an unknown field is an error, as ``kubectl apply`` with server-side
  field validation makes it), for the oldest Kubernetes sandlot documents and the newest
  the package knows.
* The RayCluster against KubeRay's CRD schema, kept in tests/deploy/schemas (source and
  licence in its README), made strict the same way.
* What the schemas cannot say: the manifests agree with the image build and with each
  other (Ray version, image, ports, labels, who is privileged).

Every check has a control: a deliberately broken copy must be rejected.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kuberay"
RAYCLUSTER_SCHEMA = Path(__file__).parent / "schemas" / "ray.io_raycluster_v1.json"
MIN_KUBERNETES = "1.30.0"
"""The oldest Kubernetes docs/kubernetes.md supports."""
KUBERNETES_VERSIONS = (MIN_KUBERNETES, kubernetes_validate.utils.latest_version())

Doc = dict[str, Any]


def _documents() -> list[Doc]:
    docs: list[Doc] = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    return docs


def _raycluster(docs: list[Doc]) -> Doc:
    found = [d for d in docs if d["kind"] == "RayCluster"]
    assert len(found) == 1
    return found[0]


def _strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused, as the API server's strict field
    validation refuses them (a CRD's structural schema only prunes them): every object
    that lists its properties, and neither preserves unknown fields nor declares a map's
    values, gets ``additionalProperties: false``. ``nullable`` becomes ``null`` allowed."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@functools.cache
def _raycluster_validator() -> Any:
    schema = _strict(json.loads(RAYCLUSTER_SCHEMA.read_text(encoding="utf-8")))
    validator = jsonschema.Draft7Validator
    validator.check_schema(schema)
    return validator(schema, format_checker=validator.FORMAT_CHECKER)


def _pod_templates(cluster: Doc) -> Iterator[tuple[str, Doc]]:
    yield "head", cluster["spec"]["headGroupSpec"]["template"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        yield group["groupName"], group["template"]


def check_raycluster(cluster: Doc) -> None:
    """Raise ``jsonschema.ValidationError`` or ``kubernetes_validate.ValidationError``."""
    errors = sorted(_raycluster_validator().iter_errors(cluster), key=lambda e: list(e.path))
    if errors:
        raise errors[0]
    for name, template in _pod_templates(cluster):
        # Kubernetes' own schema of a pod template (KubeRay's copy of it may lag behind).
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"sandlot-{name}"},
            "template": template,
        }
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(wrapped, version, strict=True)


def check_kubernetes(doc: Doc) -> None:
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def check(doc: Doc) -> None:
    if doc["apiVersion"] == "ray.io/v1":
        check_raycluster(doc)
    else:
        check_kubernetes(doc)


INVALID = (jsonschema.ValidationError, kubernetes_validate.ValidationError)


@pytest.mark.parametrize(
    "doc",
    [pytest.param(d, id=f"{d['kind']}-{d['metadata']['name']}") for d in _documents()],
)
def test_manifest_matches_its_schemas(doc: Doc) -> None:
    check(doc)


def test_every_manifest_is_checked() -> None:
    kinds = sorted(d["kind"] for d in _documents())
    assert kinds == ["NetworkPolicy", "NetworkPolicy", "RayCluster", "Service"]


# --- controls: each broken copy must be refused --------------------------------------

Breaker = Callable[[list[Doc]], Doc]


def _head_container(cluster: Doc) -> Doc:
    containers: list[Doc] = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return containers[0]


def _misspelled_pod_field(docs: list[Doc]) -> Doc:
    cluster = _raycluster(docs)
    context = _head_container(cluster)["securityContext"]
    context["privilegd"] = context.pop("privileged")
    return cluster


def _replicas_as_text(docs: list[Doc]) -> Doc:
    cluster = _raycluster(docs)
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    return cluster


def _unknown_raycluster_field(docs: list[Doc]) -> Doc:
    cluster = _raycluster(docs)
    cluster["spec"]["workerGroupSpec"] = cluster["spec"].pop("workerGroupSpecs")
    return cluster


def _no_head(docs: list[Doc]) -> Doc:
    cluster = _raycluster(docs)
    del cluster["spec"]["headGroupSpec"]
    return cluster


def _worker_group_without_name(docs: list[Doc]) -> Doc:
    cluster = _raycluster(docs)
    del cluster["spec"]["workerGroupSpecs"][0]["groupName"]
    return cluster


def _container_without_image_field_typo(docs: list[Doc]) -> Doc:
    # KubeRay's schema has the pod fields; Kubernetes' marks container names required.
    cluster = _raycluster(docs)
    del _head_container(cluster)["name"]
    return cluster


def _service_port_as_text(docs: list[Doc]) -> Doc:
    service = next(d for d in docs if d["kind"] == "Service")
    service["spec"]["ports"][0]["port"] = "eight thousand"
    return service


def _policy_unknown_field(docs: list[Doc]) -> Doc:
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    policy["spec"]["ingres"] = policy["spec"].pop("ingress")
    return policy


@pytest.mark.parametrize(
    "breaker",
    [
        _misspelled_pod_field,
        _replicas_as_text,
        _unknown_raycluster_field,
        _no_head,
        _worker_group_without_name,
        _container_without_image_field_typo,
        _service_port_as_text,
        _policy_unknown_field,
    ],
)
def test_control_broken_manifest_is_refused(breaker: Breaker) -> None:
    broken = breaker(copy.deepcopy(_documents()))
    with pytest.raises(INVALID):
        check(broken)


def test_control_crd_schema_alone_refuses_a_misspelled_pod_field() -> None:
    """The strict CRD schema on its own (not only Kubernetes' pod schema) sees pod fields."""
    broken = _misspelled_pod_field(copy.deepcopy(_documents()))
    assert list(_raycluster_validator().iter_errors(broken))
    assert not list(_raycluster_validator().iter_errors(_raycluster(_documents())))


# --- what the schemas cannot say ------------------------------------------------------


def test_ray_version_is_the_image_s() -> None:
    script = (ROOT / "scripts" / "build-node-image.sh").read_text(encoding="utf-8")
    built = re.search(r'RAY_VERSION="\$\{SANDLOT_NODE_RAY_VERSION:-([0-9.]+)\}"', script)
    assert built is not None
    assert _raycluster(_documents())["spec"]["rayVersion"] == built.group(1)


def test_one_image_and_who_is_privileged() -> None:
    cluster = _raycluster(_documents())
    images = set()
    for _name, template in _pod_templates(cluster):
        containers = template["spec"]["containers"]
        # KubeRay treats the first container as Ray's: it must be the prepared sandlot node.
        ray_container = containers[0]
        assert ray_container["command"] == ["sandlot-node-prepare"]
        assert ray_container["securityContext"] == {"privileged": True}
        for other in containers[1:]:
            context = other["securityContext"]
            assert not context.get("privileged")
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
        images |= {c["image"] for c in containers}
    assert images == {"sandlot/node:latest"}


def test_front_door_is_what_the_service_reaches() -> None:
    docs = _documents()
    cluster = _raycluster(docs)
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    door = next(c for c in head if c["name"] == "front-door")
    assert door["command"][:4] == ["sandlot", "serve", "--ray", "$(POD_IP):6379"]
    port = door["command"][door["command"].index("--port") + 1]
    assert door["ports"] == [{"name": "http", "containerPort": int(port)}]
    service = next(d for d in docs if d["kind"] == "Service")
    # KubeRay's own labels on the head pod.
    assert service["spec"]["selector"] == {
        "ray.io/cluster": cluster["metadata"]["name"],
        "ray.io/node-type": "head",
    }
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    # Only the head's front door port is open to clients; the rest to the cluster's pods.
    door_policy = policies["sandlot-front-door"]
    assert door_policy["podSelector"]["matchLabels"] == service["spec"]["selector"]
    assert door_policy["ingress"] == [{"ports": [{"port": int(port), "protocol": "TCP"}]}]
    cluster_policy = policies["sandlot-cluster"]
    assert cluster_policy["ingress"] == [{"from": [{"podSelector": cluster_policy["podSelector"]}]}]
    # The front door's driver reaches the head's raylet through its session directory.
    mounts = {m["name"]: m["mountPath"] for m in door["volumeMounts"]}
    ray_mounts = {m["name"]: m["mountPath"] for m in head[0]["volumeMounts"]}
    assert mounts["ray-tmp"] == ray_mounts["ray-tmp"] == "/tmp/ray"
