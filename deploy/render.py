"""The Helm chart as plain manifests for ``kubectl apply`` (``make manifests`` writes ``deploy/kvbridge.yaml``).

What ``helm template kvbridge charts/kvbridge --namespace kvbridge-system --include-crds`` prints, rendered in-process
with Helm's own library (helm-python-sdk, as the chart's tests render it), preceded by the Namespace that
``helm install --create-namespace`` would create: the CRDs, then the templates in Helm's install order (ServiceAccount
before the RBAC that names it, the RBAC before the Deployment). NOTES.txt is not a manifest. A test renders the chart
the same way and compares it with the checked-in file, so the two cannot drift apart.

    python deploy/render.py                       # the chart's default values, to stdout
    python deploy/render.py -o deploy/kvbridge.yaml
    python deploy/render.py --set image.repository=registry.example.com/ml/kvbridge-operator --set image.tag=0.1.0
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvbridge"
RELEASE = "kvbridge"
NAMESPACE = "kvbridge-system"
#: Helm's install order of kinds (helm.sh/helm/v3/pkg/releaseutil.InstallOrder); other kinds go last
INSTALL_ORDER = (
    "Namespace",
    "NetworkPolicy",
    "ResourceQuota",
    "LimitRange",
    "PodSecurityPolicy",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "SecretList",
    "ConfigMap",
    "StorageClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleList",
    "ClusterRoleBinding",
    "ClusterRoleBindingList",
    "Role",
    "RoleList",
    "RoleBinding",
    "RoleBindingList",
    "Service",
    "DaemonSet",
    "Pod",
    "ReplicationController",
    "ReplicaSet",
    "Deployment",
    "HorizontalPodAutoscaler",
    "StatefulSet",
    "Job",
    "CronJob",
    "IngressClass",
    "Ingress",
    "APIService",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
)
HEADER = "# kvbridge {version}: the Helm chart charts/kvbridge rendered for kubectl ({how}).\n"


def _order(kind: str) -> int:
    return INSTALL_ORDER.index(kind) if kind in INSTALL_ORDER else len(INSTALL_ORDER)


def render(values: dict[str, Any] | None = None, how: str = "make manifests; do not edit") -> str:
    """The chart with these values (none: its defaults) as one multi-document YAML file."""
    chart = helm.Chart.load(str(CHART))
    rendered = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    documents = [("namespace (helm install --create-namespace)", yaml.safe_dump(namespace, sort_keys=False))]
    documents += [(f"{RELEASE}/crds/{path.name}", path.read_text()) for path in sorted((CHART / "crds").glob("*.yaml"))]
    templates = []
    for source, text in sorted(rendered.items()):
        if not source.endswith(".yaml"):
            continue
        for document in text.split("\n---\n"):
            parsed = yaml.safe_load(document)
            if parsed:
                templates.append((_order(parsed["kind"]), source, document.removeprefix("---\n").strip("\n") + "\n"))
    documents += [(source, text) for _, source, text in sorted(templates, key=lambda t: t[0])]
    body = "".join(f"---\n# Source: {source}\n{text}" for source, text in documents)
    return HEADER.format(version=chart.metadata["appVersion"], how=how) + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a chart value, as helm's --set takes it"
    )
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for expression in args.set:
        values = _merge(values, helm.parse_set_string(expression))
    how = "make manifests; do not edit" if not args.set else "deploy/render.py --set " + " --set ".join(args.set)
    text = render(values, how)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _merge(into: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(into)
    for key, value in update.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if both else value
    return merged


if __name__ == "__main__":
    sys.exit(main())
