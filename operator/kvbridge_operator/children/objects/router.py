"""``spec.router.enabled``: kvbridge's router (``kvbridge-router``) as a Deployment, a PodDisruptionBudget and a
ClusterIP Service ``<name>-router`` (``replicas`` of 2 or more spread over nodes, each told how many there are
and where the others are: the headless Service ``<name>-router-peers``, for their reports to each other, signed
with the key of the Secret of the same name, peer_key.py),
with a ServiceAccount whose Role may only get and watch this one DisaggregatedDeployment (the router reads the
endpoints and pairings from its status; it never lists pods). With ``spec.router.signTransfers`` it signs decode's
``kv_transfer_params`` with the token of the Secret ``<name>-router-token`` (:func:`router_token_secret`;
transfer_token.py). With ``spec.router.apiKeySecret`` its pods mount that Secret's key and clients must send one
of its API keys; ``imagePullSecrets``, ``nodeSelector``, ``tolerations``, ``affinity`` and ``priorityClassName``
go into its pod spec as given.
"""

from __future__ import annotations

from kvbridge_operator.api.names import (
    HTTP_PORT_NAME,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    MANAGED_BY,
    router_name,
    router_peers_name,
    router_token_secret_name,
)
from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.router_settings import DEFAULTS, RouterSettings, arguments, peer_interval_for
from kvbridge_operator.api.serving import RouterSpec
from kvbridge_operator.api.spec import DisaggregatedDeployment
from kvbridge_operator.children import peer_key, tracing, transfer_token
from kvbridge_operator.children.objects.shared import child_metadata, owner_reference
from kvbridge_operator.config import OperatorConfig

ROUTER_PORT = DEFAULTS.port


#: the router's own program (the operator image has it)
ROUTER_COMMAND = "kvbridge-router"


#: where the router's pods mount spec.router.apiKeySecret's key (``--api-key-file``)
API_KEYS_VOLUME = "router-api-keys"


API_KEYS_FILE = "/var/run/kvbridge/router-api-keys/api-keys"


#: the router's settings written into its Deployment even at their defaults (what ``kubectl describe`` should show);
#: any other is written when the spec sets it apart from its default
RENDERED_ALWAYS = (
    "deployment",
    "namespace",
    "port",
    "prefill_timeout",
    "decode_timeout",
    "prefill_attempts",
    "policy",
    "block_size",
)


def router_selector(deployment: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, LABEL_COMPONENT: "router"}


def router_url(dd: DisaggregatedDeployment) -> str:
    """The router Service's address inside the cluster."""
    namespace = dd.metadata.namespace or "default"
    return f"http://{router_name(dd.metadata.name)}.{namespace}.svc:{ROUTER_PORT}"


def router_children(dd: DisaggregatedDeployment, uid: str, config: OperatorConfig) -> list[Obj]:
    name, namespace = router_name(dd.metadata.name), dd.metadata.namespace or "default"
    owner = owner_reference(dd, uid)
    labels = router_selector(dd.metadata.name)
    spec = dd.spec.router
    peers_service = router_peers_name(dd.metadata.name)
    return [
        *router_access(dd, name, namespace, labels, owner),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": child_metadata(name, namespace, labels, owner),
            "spec": {
                "replicas": spec.replicas,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": {**MANAGED_BY, **labels}}, "spec": router_pod_spec(dd, config)},
            },
        },
        {
            # node drains take one router at a time; with one replica the budget allows the drain (a budget that
            # forbade it would block the drain forever), so it is rendered at any count, as the engines' are
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": child_metadata(name, namespace, labels, owner),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": child_metadata(name, namespace, labels, owner),
            "spec": {
                "type": "ClusterIP",
                "selector": labels,
                "ports": [
                    {"name": HTTP_PORT_NAME, "port": ROUTER_PORT, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}
                ],
            },
        },
        *([router_peers_service(peers_service, namespace, labels, owner)] if peer_key.peers(dd.spec) else []),
    ]


def router_access(
    dd: DisaggregatedDeployment, name: str, namespace: str, labels: dict[str, str], owner: Obj
) -> list[Obj]:
    """The router's ServiceAccount, and a Role (with its binding) that may only read this one deployment."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": child_metadata(name, namespace, labels, owner)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": child_metadata(name, namespace, labels, owner),
            "rules": [
                {
                    "apiGroups": ["kvbridge.io"],
                    "resources": ["disaggregateddeployments"],
                    "resourceNames": [dd.metadata.name],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": child_metadata(name, namespace, labels, owner),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def router_settings(dd: DisaggregatedDeployment) -> RouterSettings:
    """What the router is told (its arguments): the deployment, its timeouts and policy, and the files and peers of
    the features the spec turns on."""
    namespace, spec = dd.metadata.namespace or "default", dd.spec.router
    signs, peers = transfer_token.signs(dd.spec), peer_key.peers(dd.spec)
    peers_service = router_peers_name(dd.metadata.name)
    return RouterSettings(
        deployment=dd.metadata.name,
        namespace=namespace,
        port=ROUTER_PORT,
        prefill_timeout=spec.prefill_timeout_seconds,
        cold_timeout=spec.cold_timeout_seconds,
        decode_timeout=spec.decode_timeout_seconds,
        prefill_attempts=spec.prefill_attempts,
        policy=spec.policy,
        block_size=dd.spec.prefill.block_size,
        replicas=spec.replicas,
        transfer_token_file=transfer_token.TOKEN_FILE if signs else "",
        peers=f"dns:{peers_service}.{namespace}.svc:{ROUTER_PORT}" if peers else "",
        peer_key_file=peer_key.KEY_FILE if peers else "",
        peer_interval=peer_interval_for(spec.replicas),
        api_key_file=API_KEYS_FILE if spec.api_key_secret else "",
    )


def router_pod_spec(dd: DisaggregatedDeployment, config: OperatorConfig) -> Obj:
    """The router pods' spec: its container, the volumes of its files, its spread and placement."""
    spec = dd.spec.router
    volumes, mounts = router_volumes(dd)
    probe = {"httpGet": {"path": "/metrics", "port": HTTP_PORT_NAME}, "periodSeconds": 10}
    env = tracing.env_list(dd.spec, tracing.service_name(dd.metadata.name, "router"))
    container: Obj = {
        "name": "router",
        "image": spec.image or config.router_image,
        "command": [ROUTER_COMMAND],
        "args": arguments(router_settings(dd), always=RENDERED_ALWAYS),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        **({"env": env} if env else {}),
        # ready once some prefill/decode pair is routable (503 before); alive while it answers at all
        "readinessProbe": {"httpGet": {"path": "/health", "port": HTTP_PORT_NAME}, "periodSeconds": 5},
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": spec.resources or {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        **({"volumeMounts": mounts} if mounts else {}),
    }
    labels = router_selector(dd.metadata.name)
    return {
        "serviceAccountName": router_name(dd.metadata.name),
        "containers": [container],
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        **({"volumes": volumes} if volumes else {}),
        **router_spread(spec, labels),
        **router_placement(spec),
    }


def router_volumes(dd: DisaggregatedDeployment) -> tuple[list[Obj], list[Obj]]:
    """The router's Secret volumes and their mounts: the transfer token, the peers' key, the API keys."""
    spec = dd.spec.router
    signs, peers = transfer_token.signs(dd.spec), peer_key.peers(dd.spec)
    # the token's and the keys' files are root's: readable by the router's non-root user
    volumes = [transfer_token.volume(dd.metadata.name, 0o444)] if signs else []
    mounts = [transfer_token.mount()] if signs else []
    if peers:
        volumes.append(peer_key.volume(dd.metadata.name))
        mounts.append(peer_key.mount())
    if spec.api_key_secret is not None:
        items = [{"key": spec.api_key_secret.key, "path": API_KEYS_FILE.rpartition("/")[2]}]
        secret = {"secretName": spec.api_key_secret.name, "items": items, "defaultMode": 0o444}
        volumes.append({"name": API_KEYS_VOLUME, "secret": secret})
        # not a subPath mount: the kubelet updates the file when the Secret changes, and the router reads it again
        mounts.append({"name": API_KEYS_VOLUME, "mountPath": API_KEYS_FILE.rpartition("/")[0], "readOnly": True})
    return volumes, mounts


def router_peers_service(name: str, namespace: str, labels: dict[str, str], owner: Obj) -> Obj:
    """The routers' headless Service: its name resolves to every router pod's address, ready or not (a replica
    starting reports and is reported to before it serves), for the replicas' reports to each other (peering.py)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(name, namespace, labels, owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": [{"name": HTTP_PORT_NAME, "port": ROUTER_PORT, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}],
        },
    }


def router_spread(spec: RouterSpec, labels: dict[str, str]) -> Obj:
    """Two or more routers: spread over nodes where the scheduler can (``ScheduleAnyway``: a one-node cluster still
    runs them all; ``affinity`` with a ``podAntiAffinity`` makes it a requirement)."""
    if spec.replicas < 2:
        return {}
    spread = {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": labels},
    }
    return {"topologySpreadConstraints": [spread]}


def router_placement(spec: RouterSpec) -> Obj:
    """The router pods' scheduling fields from ``spec.router``, each only when set (Kubernetes' own defaults
    otherwise)."""
    fields: Obj = {
        "imagePullSecrets": [{"name": ref.name} for ref in spec.image_pull_secrets],
        "nodeSelector": dict(spec.node_selector),
        "tolerations": [t.model_dump(mode="json", by_alias=True, exclude_defaults=True) for t in spec.tolerations],
        "affinity": dict(spec.affinity),
        "priorityClassName": spec.priority_class_name,
    }
    return {key: value for key, value in fields.items() if value}


def router_token_secret(dd: DisaggregatedDeployment, uid: str) -> Obj:
    """The router's token (``spec.router.signTransfers``, transfer_token.py): a fresh one; created once, never
    patched (rotation is an explicit action)."""
    namespace = dd.metadata.namespace or "default"
    name = router_token_secret_name(dd.metadata.name)
    metadata = child_metadata(name, namespace, {LABEL_DEPLOYMENT: dd.metadata.name}, owner_reference(dd, uid))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata,
        "data": transfer_token.secret_data(),
    }
