"""The Helm chart rendered and linted by Helm's own Go code (helm-python-sdk binds Helm v4's SDK)
and every object validated offline, strictly, against the Kubernetes schemas of the oldest and
newest versions the chart supports (kubernetes-validate). Each value in values.yaml changes what
renders, so none is dead."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from deploy_images import ROOT

helm = pytest.importorskip("helm_python", reason="needs Helm's SDK: run `make test-deploy`")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = ROOT / "helm" / "tierd"
KUBERNETES = ("1.25.0", "1.37.0")   # the oldest and newest schemas the chart is checked against
CRDS = {"monitoring.coreos.com/v1"}  # ServiceMonitor: the Prometheus Operator's, no core schema

# Values that switch on every optional object, so each value has something to change.
EVERYTHING: dict[str, Any] = {
    "tcp": {"enabled": True, "tokenSecret": "tierd-tcp"},
    "engineGroup": 2000,
    "serviceMonitor": {"enabled": True},
    "grafanaDashboard": {"enabled": True, "folder": "tierd"},
    "remoteTier": {"enabled": True},
    "priorityClassName": "system-node-critical",
}
SETTINGS: list[dict[str, Any]] = [{}, EVERYTHING, {"redis": {"enabled": False,
                                                            "url": "redis://r:6379/0"}}]


def render(values: dict[str, Any]) -> dict[str, str]:
    manifests: dict[str, str] = helm.Chart.load(CHART).render(values, name="rel",
                                                              namespace="ns")
    return manifests


def objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [doc for text in render(values).values() for doc in yaml.safe_load_all(text) if doc]


@pytest.mark.parametrize("values", SETTINGS, ids=["defaults", "everything", "external-redis"])
def test_chart_lints_strict(values: dict[str, Any]) -> None:
    """`helm lint --strict` finds no warning or error (infos such as a missing icon aside)."""
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("version", KUBERNETES)
@pytest.mark.parametrize("values", SETTINGS, ids=["defaults", "everything", "external-redis"])
def test_every_object_validates_strictly(values: dict[str, Any], version: str) -> None:
    """Every rendered object is valid against Kubernetes' own schema, unknown fields rejected."""
    rendered = objects(values)
    assert {o["kind"] for o in rendered} >= {"DaemonSet", "Service"}
    for obj in rendered:
        if obj["apiVersion"] in CRDS:
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_tcp_without_a_token_secret_fails_to_render() -> None:
    """A TCP listener without its bearer token is refused at render time, naming the value."""
    with pytest.raises(helm.HelmRenderError, match="tcp.tokenSecret"):
        render({"tcp": {"enabled": True}})


def test_published_address_is_dialable() -> None:
    """With TCP on, the published node address is the pod IP, served on a container port and
    bound on all interfaces; with TCP off nothing publishes a bare IP."""
    (daemon,) = [o for o in objects(EVERYTHING) if o["kind"] == "DaemonSet"]
    container = daemon["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["TIERD_NODE_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["TIERD_TCP_HOST"]["value"] == "0.0.0.0"
    assert env["TIERD_TCP_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tierd-tcp"
    assert {"name": "grpc", "containerPort": 50051} in container["ports"]
    (plain,) = [o for o in objects({}) if o["kind"] == "DaemonSet"]
    names = {e["name"] for e in plain["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "TIERD_NODE_ADDRESS" not in names and "TIERD_TCP_PORT" not in names


def _leaves(tree: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key)


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 7
    if isinstance(value, dict):
        return {"tierd.test/changed": "yes"}
    if isinstance(value, list):
        return [{"key": "tierd.test/changed", "operator": "Exists"}]
    return f"{value}9" if value else "changed"


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return tree


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def test_every_value_is_used() -> None:
    """Changing any value in values.yaml changes the rendered manifests under at least one of
    the settings (defaults, every option on, an external Redis)."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    unused = []
    for path in _leaves(defaults):
        for setting in (EVERYTHING, *SETTINGS):
            base = _merged(defaults, setting)
            current: Any = base
            for key in path:
                current = current[key]
            try:
                changed = render(_set(base, path, _changed(current)))
            except helm.HelmRenderError:
                break   # the value decides whether the chart renders at all: it is used
            if changed != render(base):
                break
        else:
            unused.append(".".join(path))
    assert unused == []
