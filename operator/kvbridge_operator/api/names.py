"""The names the operator gives things: API group and kinds, label and annotation keys, child and port names.

One module, so the renderer, the controller, the router and the tests agree on every name without importing each
other's logic.
"""

from __future__ import annotations

from kvbridge_agent.core import Role

# -- the API ------------------------------------------------------------------------------------------------------
GROUP = "kvbridge.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedDeployment"
PLURAL = "disaggregateddeployments"
#: one per role, with the /scale subresource (HPA, KEDA, kubectl scale)
ROLE_KIND = "DisaggregatedRole"
ROLE_PLURAL = "disaggregatedroles"

# -- the kinds kvbridge renders besides the built-in ones -----------------------------------------------------------
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
#: what runs a role's engines: one pod per engine, or a group of pods per engine (children/multinode.py)
WORKLOAD_KINDS = ("StatefulSet", LWS_KIND)
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
POD_GROUP_API = "scheduling.x-k8s.io/v1alpha1"

# -- labels ---------------------------------------------------------------------------------------------------------
LABEL_DEPLOYMENT = "kvbridge.io/deployment"
LABEL_ROLE = "kvbridge.io/role"
LABEL_FINGERPRINT = "kvbridge.io/fingerprint"
LABEL_REVISION = "kvbridge.io/revision"
LABEL_PAIRING = "kvbridge.io/pairing"
LABEL_TP = "kvbridge.io/tensor-parallel-size"
#: an engine pod's data-parallel ranks, on pods of a role with more than one (absent: one)
LABEL_DP = "kvbridge.io/data-parallel-size"
#: the data-parallel ranks each pod of an engine spanning nodes runs (absent: all of them)
LABEL_DP_LOCAL = "kvbridge.io/data-parallel-size-local"
#: namespaces labelled so may reach the engines' HTTP APIs (a router or gateway outside the deployment's namespace)
LABEL_API_ACCESS = "kvbridge.io/api-access"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kvbridge", "app.kubernetes.io/part-of": "kvbridge"}
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_LLM_D_ROLE = "llm-d.ai/role"
#: the label LWS puts on every pod of a group: its index in the group (the leader's is 0)
LABEL_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LABEL_POD_GROUP = "scheduling.x-k8s.io/pod-group"
#: on the pods that serve a deployment's model API (single-pod engines, the leaders of multi-node groups) when
#: spec.inferencePool is on: what the InferencePool selects, so the router's pods and headless workers are not in it
LABEL_INFERENCE_POOL = "kvbridge.io/inference-pool"

# -- annotations ----------------------------------------------------------------------------------------------------
#: the deployment's spec.<role>.replicas last written into the role's spec.replicas (so a change is seen once)
ANNOTATION_SPEC_REPLICAS = "kvbridge.io/spec-replicas"
#: the prefill pods' incarnations last seen (for PrefillRestarted)
PODS_ANNOTATION = "kvbridge.io/prefill-pods"

# -- containers, ports, volumes -------------------------------------------------------------------------------------
ENGINE_CONTAINER = "engine"
SIDE_CHANNEL_PORT_NAME = "side-channel"
#: the container port of a further data-parallel rank's side channel (rank 0's is SIDE_CHANNEL_PORT_NAME); a port's
#: name has at most 15 characters, so not side-channel-<rank>
DP_SIDE_CHANNEL_PORT_PREFIX = "side-dp"


def side_channel_port_name(dp_rank: int) -> str:
    """The container port name of one data-parallel rank's side channel."""
    return SIDE_CHANNEL_PORT_NAME if dp_rank == 0 else f"{DP_SIDE_CHANNEL_PORT_PREFIX}{dp_rank}"


def is_side_channel_port_name(name: object) -> bool:
    """Whether ``name`` is one of the side-channel ports kvbridge renders (any data-parallel rank's)."""
    if not isinstance(name, str):
        return False
    rank = name.removeprefix(DP_SIDE_CHANNEL_PORT_PREFIX)
    return name == SIDE_CHANNEL_PORT_NAME or (rank != name and rank.isdigit())


HTTP_PORT_NAME = "http"
KEYS_VOLUME = "side-channel-keys"
#: the router's token (spec.router.signTransfers), on the router's pods and the decode engines'
ROUTER_TOKEN_VOLUME = "router-token"
ROUTER_PEERS_VOLUME = "router-peers-key"


# -- child names ----------------------------------------------------------------------------------------------------
def role_name(deployment: str, role: Role) -> str:
    """A role's workload, headless Service, DisaggregatedRole and PodDisruptionBudget."""
    return f"{deployment}-{role.value}"


def secret_name(deployment: str) -> str:
    return f"{deployment}-side-channel"


def router_token_secret_name(deployment: str) -> str:
    """The router's token for signing decode's transfer parameters (spec.router.signTransfers)."""
    return f"{deployment}-router-token"


def network_policy_name(deployment: str) -> str:
    return f"{deployment}-pods"


def router_name(deployment: str) -> str:
    return f"{deployment}-router"


def router_peers_name(deployment: str) -> str:
    """The routers' headless Service (two or more replicas), whose name resolves to every router pod, and the Secret
    of the key their reports to each other are signed with."""
    return f"{deployment}-router-peers"
