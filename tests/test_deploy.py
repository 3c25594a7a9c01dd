"""Deployment files checked without a cluster or Docker: docker-compose.yml, the Dockerfile and
the Helm chart parse, carry their required keys, and every template placeholder resolves
against the chart's default values.

The Helm templates are rendered by a tiny resolver of the subset they use: ``{{ PATH }}``,
``{{ PATH | quote }}``, ``{{ toYaml PATH | nindent N }}``, ``{{ if PATH }}``/``else``/``end``
with ``{{-``/``-}}`` whitespace trimming; PATH is ``.Values.a.b``, ``.Release.Name``,
``.Release.Namespace``, ``.Chart.Name`` or ``.Chart.Version``. Anything else fails the test, so a
template that grows past the subset is noticed here (render it with ``helm template`` then).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tierd"
_TAG = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def _go_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


class Resolver:
    """Evaluates the template subset against a context; records every ``.Values`` path used."""

    def __init__(self, values: dict[str, Any], chart: dict[str, Any]) -> None:
        self.context = {"Values": values, "Release": {"Name": "rel", "Namespace": "ns"},
                        "Chart": {"Name": chart["name"], "Version": chart["version"]}}
        self.used: set[str] = set()

    def lookup(self, path: str) -> Any:
        assert re.fullmatch(r"(\.[A-Za-z_][A-Za-z0-9_]*)+", path), f"unsupported expr {path!r}"
        node: Any = self.context
        for part in path[1:].split("."):
            assert isinstance(node, dict) and part in node, f"{path} does not resolve"
            node = node[part]
        if path.startswith(".Values."):
            self.used.add(path.removeprefix(".Values."))
        return node

    def value(self, expr: str) -> str:
        match = re.fullmatch(r"toYaml (\S+) \| nindent (\d+)", expr)
        if match:
            dumped = yaml.safe_dump(self.lookup(match.group(1)), default_flow_style=False)
            pad = " " * int(match.group(2))
            return "\n" + "\n".join(pad + line for line in dumped.rstrip("\n").split("\n"))
        match = re.fullmatch(r"(\S+) \| quote", expr)
        if match:
            text = _go_str(self.lookup(match.group(1)))
            return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return _go_str(self.lookup(expr))

    def render(self, text: str) -> str:
        pieces = _TAG.split(text)       # text, trim-left, expr, trim-right, text, ...
        texts, tags = pieces[0::4], list(zip(pieces[1::4], pieces[2::4], pieces[3::4]))
        for i, (left, _, right) in enumerate(tags):
            if left:
                texts[i] = texts[i].rstrip()
            if right:
                texts[i + 1] = texts[i + 1].lstrip()
        out, active = [texts[0]], [True]
        for i, (_, expr, _) in enumerate(tags):
            if expr.startswith("if "):
                active.append(active[-1] and bool(self.lookup(expr[3:].strip())))
            elif expr == "else":
                assert len(active) > 1, "else without if"
                active[-1] = active[-2] and not active[-1]
            elif expr == "end":
                assert len(active) > 1, "end without if"
                active.pop()
            elif active[-1]:
                out.append(self.value(expr))
            if active[-1]:
                out.append(texts[i + 1])
        assert len(active) == 1, "unclosed if"
        return "".join(out)


def _values() -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(values, dict)
    return values


def render_chart(values: dict[str, Any]) -> tuple[list[dict[str, Any]], Resolver]:
    """Every manifest of the chart with ``values``, as parsed YAML documents."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    resolver = Resolver(values, chart)
    docs = []
    for template in sorted((CHART / "templates").glob("*.yaml")):
        for doc in yaml.safe_load_all(resolver.render(template.read_text())):
            if doc is not None:
                docs.append(doc)
    return docs, resolver


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out += _leaves(value, path + ".") if isinstance(value, dict) and value else [path]
    return out


def test_chart_metadata_and_values_parse() -> None:
    """Chart.yaml is a v2 application chart; values.yaml documents the required sections."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["apiVersion"], chart["name"], chart["type"]) == ("v2", "tierd", "application")
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    values = _values()
    for key in ("image", "dram", "ssd", "socket", "metrics", "serviceMonitor", "memlock",
                "resources", "redis", "remoteTier"):
        assert key in values, f"values.yaml lacks {key}"
    assert (CHART / "README.md").is_file()


def test_default_render_has_daemonset_service_and_redis() -> None:
    """Default values: a DaemonSet with the three hostPaths, IPC_LOCK, resources, metrics port
    and the in-release Redis URL; the metrics Service; a Redis Deployment and Service; no
    ServiceMonitor. Every values.yaml leaf is used by some template."""
    values = _values()
    docs, resolver = render_chart(copy.deepcopy(values))
    assert sorted(d["kind"] for d in docs) == ["DaemonSet", "Deployment", "Service", "Service"]
    pod = by_kind(docs, "DaemonSet")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    assert volumes == {"socket": values["socket"]["hostPath"], "shm": "/dev/shm",
                       "ssd": values["ssd"]["hostPath"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"socket": "/run/tierd", "shm": "/dev/shm", "ssd": "/var/lib/tierd/ssd"}
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert container["resources"] == values["resources"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400}]
    env = env_of(container)
    assert env["TIERD_REDIS_URL"] == "redis://rel-redis:6379/0"
    assert env["TIERD_DRAM_BYTES"] == "8GiB" and env["TIERD_REMOTE_TIER"] == "false"
    assert env["TIERD_NODE_ID"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    service = [d for d in by_kind(docs, "Service") if d["metadata"]["name"].endswith("metrics")]
    assert service[0]["spec"]["ports"][0]["port"] == 9400
    assert resolver.used >= {"dram.bytes", "resources", "metrics.port", "redis.enabled"}


def test_every_placeholder_resolves_and_every_value_is_used() -> None:
    """Each ``.Values`` path written in a template (in taken and untaken branches alike)
    exists in values.yaml, and every values.yaml leaf appears in some template."""
    values = _values()
    resolver = Resolver(values, {"name": "tierd", "version": "0.1.0"})
    written = set()
    for template in (CHART / "templates").glob("*.yaml"):
        for path in re.findall(r"\.Values(?:\.[A-Za-z_][A-Za-z0-9_]*)+", template.read_text()):
            resolver.lookup(path)
            written.add(path.removeprefix(".Values."))
    unused = [leaf for leaf in _leaves(values)
              if not any(u == leaf or leaf.startswith(u + ".") for u in written)]
    assert unused == [], f"values.yaml keys no template uses: {unused}"


def test_toggles_external_redis_and_servicemonitor() -> None:
    """redis.enabled=false uses redis.url and renders no Redis; serviceMonitor.enabled renders
    one ServiceMonitor on the metrics port; ipcLock=false adds no capability."""
    values = _values()
    values["redis"].update(enabled=False, url="redis://shared:6379/3")
    values["serviceMonitor"]["enabled"] = True
    values["memlock"]["ipcLock"] = False
    docs, _ = render_chart(values)
    assert sorted(d["kind"] for d in docs) == ["DaemonSet", "Service", "ServiceMonitor"]
    container = by_kind(docs, "DaemonSet")[0]["spec"]["template"]["spec"]["containers"][0]
    assert env_of(container)["TIERD_REDIS_URL"] == "redis://shared:6379/3"
    assert "add" not in container["securityContext"]["capabilities"]
    monitor = by_kind(docs, "ServiceMonitor")[0]
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "15s"}]


def test_resolver_rejects_unknown_placeholders() -> None:
    """A placeholder outside values.yaml fails loudly instead of rendering empty."""
    resolver = Resolver(_values(), {"name": "tierd", "version": "0.1.0"})
    with pytest.raises(AssertionError, match="does not resolve"):
        resolver.render("a: {{ .Values.nope.missing }}")


def _compose() -> dict[str, Any]:
    text = (ROOT / "docker-compose.yml").read_text()
    text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)     # ${VAR:-default} -> default
    assert "${" not in text, "a compose variable without a default"
    compose = yaml.safe_load(text)
    assert isinstance(compose, dict)
    return compose


def test_compose_services_share_ipc_socket_and_have_health_checks() -> None:
    """redis, tierd and demo: tierd waits for a healthy Redis, the demo for a healthy tierd;
    the demo joins tierd's IPC namespace (its /dev/shm) and socket volume."""
    services = _compose()["services"]
    assert set(services) == {"redis", "tierd", "demo"}
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    tierd, demo = services["tierd"], services["demo"]
    assert "healthcheck" in tierd and tierd["build"] == "."
    assert tierd["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert demo["depends_on"] == {"tierd": {"condition": "service_healthy"}}
    assert (tierd["ipc"], demo["ipc"]) == ("shareable", "service:tierd")
    assert "tierd-run:/run/tierd" in tierd["volumes"] and "tierd-run:/run/tierd" in demo["volumes"]
    assert tierd["environment"]["TIERD_SOCKET_PATH"] == demo["environment"]["TIERD_SOCKET_PATH"]
    assert tierd["environment"]["TIERD_REDIS_URL"] == "redis://redis:6379/0"
    assert tierd["ulimits"]["memlock"] == {"soft": -1, "hard": -1}


def test_dockerfile_builds_tierd_on_python_slim_with_cpu_torch() -> None:
    """The Dockerfile starts from python:3.11-slim, installs CPU torch, the package, a health
    check and runs `tierd serve` as a non-root user."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text
    assert "pip install ." in text and "HEALTHCHECK" in text
    assert 'ENTRYPOINT ["tierd"]' in text and 'CMD ["serve"]' in text
    assert re.search(r"^USER tierd$", text, re.M)
