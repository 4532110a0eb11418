"""Generate the CustomResourceDefinition from the pydantic models (the one source of truth).

    kvbridge crd                 # print the YAML
    kvbridge crd -o crds/        # write crds/disaggregateddeployments.kvbridge.io.yaml

The JSON schema pydantic produces is turned into a Kubernetes *structural*
schema: references inlined, ``Optional`` unwrapped, OpenAPI v3.0 bounds,
unknown-field preservation only where the spec allows free-form objects
(pod template overlays), conditions as a list map keyed by ``type``, and
cross-field rules as ``x-kubernetes-validations`` in core CEL.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from kvbridge_operator.api.images import KVBRIDGE_ENGINE_REPOSITORY, STOCK_VLLM_PATTERN
from kvbridge_operator.api.names import GROUP, KIND, PLURAL, ROLE_KIND, ROLE_PLURAL, VERSION
from kvbridge_operator.api.spec import CONNECTOR_KINDS, MAX_NAME_LENGTH, NAME_PATTERN, DisaggregatedDeploymentSpec
from kvbridge_operator.api.status import DisaggregatedDeploymentStatus

CRD_NAME = f"{PLURAL}.{GROUP}"
FILE_NAME = f"{CRD_NAME}.yaml"
ROLE_CRD_NAME = f"{ROLE_PLURAL}.{GROUP}"
ROLE_FILE_NAME = f"{ROLE_CRD_NAME}.yaml"
_KEPT = (
    "type",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "description",
    "default",
    "format",
)

#: Cross-field shape rules on spec, in core CEL (cel-python checks them in the tests).
SPEC_RULES: list[dict[str, str]] = [
    {
        "rule": "self.prefill.tensorParallelSize % self.decode.tensorParallelSize == 0 || "
        "self.decode.tensorParallelSize % self.prefill.tensorParallelSize == 0",
        "message": "prefill and decode tensorParallelSize must divide one another",
        "fieldPath": ".decode.tensorParallelSize",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.prefill.blockSize % self.decode.blockSize == 0 || "
        "self.decode.blockSize % self.prefill.blockSize == 0",
        "message": "prefill and decode blockSize must divide one another",
        "fieldPath": ".decode.blockSize",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.model.attention != 'MLA' || self.model.numKVHeads == 1",
        "message": "MLA keeps one latent per token: numKVHeads must be 1 (put the latent width in headDim)",
        "fieldPath": ".model.numKVHeads",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.model.cacheKind != 'CrossLayer' || "
        "(self.prefill.kvLayout == 'HND' && self.decode.kvLayout == 'HND')",
        "message": "cacheKind CrossLayer needs kvLayout HND on both sides",
        "fieldPath": ".model.cacheKind",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.model.cacheKind != 'CrossLayer' || self.prefill.blockSize == self.decode.blockSize",
        "message": "cacheKind CrossLayer needs equal prefill and decode blockSize",
        "fieldPath": ".decode.blockSize",
        "reason": "FieldValueInvalid",
    },
    *(
        {
            "rule": f"self.{role}.minReplicas <= self.{role}.replicas && "
            f"self.{role}.replicas <= self.{role}.maxReplicas",
            "message": f"{role}: replicas must lie within minReplicas and maxReplicas",
            "fieldPath": f".{role}.replicas",
            "reason": "FieldValueInvalid",
        }
        for role in ("prefill", "decode")
    ),
    *(
        {
            "rule": f"!has(self.{role}.rollout) || "
            f"self.{role}.rollout.maxSurge + self.{role}.rollout.maxUnavailable >= 1",
            "message": f"{role}.rollout: maxSurge + maxUnavailable must be at least 1",
            "fieldPath": f".{role}.rollout",
            "reason": "FieldValueInvalid",
        }
        for role in ("prefill", "decode")
    ),
    *(
        {
            "rule": "!has(self.autoscaling) || !has(self.autoscaling.enabled) || !self.autoscaling.enabled || "
            f"self.{role}.minReplicas >= 1",
            "message": f"{role}.minReplicas is 0 with autoscaling.enabled: the planner would scale the role to 0 "
            "when idle and nothing brings it back: set minReplicas: 1 or more; scale from zero is not supported",
            "fieldPath": f".{role}.minReplicas",
            "reason": "FieldValueInvalid",
        }
        for role in ("prefill", "decode")
    ),
    {
        "rule": "!has(self.scaling.decodePerPrefill) || !has(self.scaling.decodePerPrefill.min) || "
        "!has(self.scaling.decodePerPrefill.max) || "
        "self.scaling.decodePerPrefill.min <= self.scaling.decodePerPrefill.max",
        "message": "scaling.decodePerPrefill: min must not be above max",
        "fieldPath": ".scaling.decodePerPrefill",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "self.transfer.conversion != 'Off' || self.prefill.blockSize == self.decode.blockSize",
        "message": "with conversion Off, prefill and decode blockSize must be equal",
        "fieldPath": ".decode.blockSize",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.inferencePool) || !has(self.inferencePool.enabled) || !self.inferencePool.enabled || "
        "(has(self.inferencePool.endpointPicker) && self.inferencePool.endpointPicker != '')",
        "message": "endpointPicker must name the Endpoint Picker's Service when the pool is enabled",
        "fieldPath": ".inferencePool.endpointPicker",
        "reason": "FieldValueRequired",
    },
    {
        "rule": "!has(self.router) || !has(self.router.signTransfers) || !self.router.signTransfers || "
        "(has(self.router.enabled) && self.router.enabled)",
        "message": "signTransfers needs kvbridge's router, which signs what decode is handed: set router.enabled: true",
        "fieldPath": ".router.signTransfers",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.router) || !has(self.router.apiKeySecret) || (has(self.router.enabled) && "
        "self.router.enabled)",
        "message": "apiKeySecret authenticates clients of kvbridge's router: set router.enabled: true",
        "fieldPath": ".router.apiKeySecret",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.router) || !has(self.router.tolerations) || self.router.tolerations.all(t, "
        "(!has(t.operator) || t.operator == 'Equal') ? (has(t.key) && t.key != '') : (!has(t.value) || t.value == ''))",
        "message": "a toleration with operator Equal needs a key, one with operator Exists takes no value",
        "fieldPath": ".router.tolerations",
        "reason": "FieldValueInvalid",
    },
    {
        # the model's IMAGE_LACKS_CONNECTOR on spec.engine.image (a role's template overlay, which CEL cannot read,
        # is refused by the operator's model alone); a CEL string takes the pattern's backslashes doubled
        "rule": "!has(self.engine) || !has(self.engine.connector) || self.engine.connector != 'KVBridge' || "
        "(has(self.engine.kind) && "
        + " && ".join(f"self.engine.kind != '{kind}'" for kind in sorted(CONNECTOR_KINDS))
        + ") || !has(self.engine.image) || "
        f"!self.engine.image.matches('{STOCK_VLLM_PATTERN.replace(chr(92), chr(92) * 2)}')",
        "message": "connector KVBridge needs kvbridge in the engine's image, and vLLM's own images do not have it: "
        f"use kvbridge's engine image ({KVBRIDGE_ENGINE_REPOSITORY}), an image of your own with kvbridge installed, "
        "or no image (the operator's default)",
        "fieldPath": ".engine.image",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "(!has(self.model.tokenSecret) && !has(self.model.cache)) || "
        "(has(self.model.source) && self.model.source.startsWith('hf://'))",
        "message": "tokenSecret and cache are for downloads: set source to hf://ORG/NAME@REVISION",
        "fieldPath": ".model.source",
        "reason": "FieldValueInvalid",
    },
    {
        "rule": "!has(self.placement) || !has(self.placement.colocation) || self.placement.colocation == 'None' || "
        "(has(self.placement.topologyKey) && self.placement.topologyKey != '')",
        "message": "colocation needs topologyKey: the node label whose value names the shared domain",
        "fieldPath": ".placement.topologyKey",
        "reason": "FieldValueRequired",
    },
]


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node as a Kubernetes structural-schema node."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return structural(merged, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        rest = {k: v for k, v in node.items() if k != "allOf"}
        return structural({**node["allOf"][0], **rest}, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(options) == 1:
            return structural({**options[0], **rest}, defs)
        kinds = {o.get("type") for o in options}
        if kinds == {"string", "integer"}:
            described = {k: rest[k] for k in ("description",) if k in rest}
            return {**described, "x-kubernetes-int-or-string": True}
        raise ValueError(f"cannot express anyOf {options} in a structural schema")
    out: dict[str, Any] = {k: node[k] for k in _KEPT if k in node}
    if out.get("default", 0) is None:  # a null default is not valid in a structural schema
        del out["default"]
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if "enum" in node and "type" not in out:
        out["type"] = "string"
    kind = out.get("type")
    if kind == "object" or "properties" in node:
        out["type"] = "object"
        properties = node.get("properties")
        if properties:
            out["properties"] = {name: structural(value, defs) for name, value in properties.items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        else:
            extra = node.get("additionalProperties", True)
            if extra is True or extra == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            else:
                out["additionalProperties"] = structural(extra, defs)
    elif kind == "array":
        out["items"] = structural(node.get("items", {}), defs)
    return out


#: rules on the whole resource: the name must make valid children (``<name>-prefill`` Service and StatefulSet)
ROOT_RULES: list[dict[str, str]] = [
    {
        "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')",
        "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters, start with a letter and have no "
        "dots: it names the <name>-prefill and <name>-decode Services and StatefulSets",
    },
]


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return structural(raw, defs)


def spec_schema() -> dict[str, Any]:
    schema = model_schema(DisaggregatedDeploymentSpec)
    for section in ("engine", "transfer", "prefill", "decode", "scaling", "router", "inferencePool", "placement"):
        schema["properties"][section]["default"] = {}  # so nested defaults apply before CEL rules run
    schema["x-kubernetes-validations"] = SPEC_RULES
    return schema


def status_schema() -> dict[str, Any]:
    schema = model_schema(DisaggregatedDeploymentStatus)
    conditions = schema["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def _definition(kind: str, plural: str, short_names: list[str], version: dict[str, Any]) -> dict[str, Any]:
    """A namespaced CustomResourceDefinition of kvbridge's group with one version."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/name": "kvbridge"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short_names,
                "categories": ["kvbridge"],
            },
            "scope": "Namespaced",
            "versions": [version],
        },
    }


def _version(
    subresources: dict[str, Any],
    columns: list[dict[str, str]],
    description: str,
    spec: dict[str, Any],
    status: dict[str, Any],
    rules: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The one served and stored version: its subresources, printer columns and the object's structural schema."""
    schema: dict[str, Any] = {
        "type": "object",
        "description": description,
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
    }
    if rules is not None:
        schema["x-kubernetes-validations"] = rules
    return {
        "name": VERSION,
        "served": True,
        "storage": True,
        "subresources": subresources,
        "additionalPrinterColumns": columns,
        "schema": {"openAPIV3Schema": schema},
    }


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a dict."""
    columns = [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Available", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Available")].status'},
        {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.ready"},
        {"name": "Decode", "type": "string", "jsonPath": ".status.decode.ready"},
        {"name": "TP", "type": "string", "jsonPath": ".status.tp"},
        {"name": "Router", "type": "string", "jsonPath": ".status.router.url"},
        {"name": "Planner", "type": "string", "jsonPath": ".status.autoscaling.state"},
        {"name": "Planned", "type": "string", "jsonPath": ".status.autoscaling.planned"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    description = (
        "A prefill/decode disaggregated LLM deployment whose KV-cache compatibility kvbridge checks before scheduling."
    )
    version = _version({"status": {}}, columns, description, spec_schema(), status_schema(), ROOT_RULES)
    return _definition(KIND, PLURAL, ["dd", "disagg"], version)


#: the DisaggregatedRole's counts: engines of one role
_ROLE_COUNT = {"type": "integer", "minimum": 0, "maximum": 1024}


def _role_spec_schema() -> dict[str, Any]:
    """The DisaggregatedRole's spec: which deployment and role, and the desired count (its /scale)."""
    return {
        "type": "object",
        "required": ["deployment", "role"],
        "properties": {
            "deployment": {
                "type": "string",
                "maxLength": 253,
                "description": "The DisaggregatedDeployment this role belongs to.",
            },
            "role": {"type": "string", "enum": ["prefill", "decode"]},
            "replicas": {**_ROLE_COUNT, "description": "Desired engines (autoscalers write it)."},
        },
        "x-kubernetes-validations": [
            {
                "rule": "self.deployment == oldSelf.deployment && self.role == oldSelf.role",
                "message": "deployment and role are immutable",
            }
        ],
    }


def _role_status_schema() -> dict[str, Any]:
    """The DisaggregatedRole's status: the counts the operator runs, and the selector HPA reads."""
    return {
        "type": "object",
        "properties": {
            "replicas": {
                **_ROLE_COUNT,
                "description": "Engines the operator runs (the scale subresource's current count; the same as "
                "effectiveReplicas).",
            },
            "desiredReplicas": {**_ROLE_COUNT, "description": "spec.replicas as the operator last saw it."},
            "effectiveReplicas": {
                **_ROLE_COUNT,
                "description": "Engines the operator runs: the desired count within minReplicas, maxReplicas and "
                "decodePerPrefill.",
            },
            "selector": {"type": "string", "description": "The role's pods (for HPA)."},
            "message": {
                "type": "string",
                "maxLength": 1024,
                "description": "Why effective differs from desired, if it does.",
            },
        },
    }


def role_crd() -> dict[str, Any]:
    """The DisaggregatedRole: one per role of a deployment, what HPA, KEDA and ``kubectl scale`` target (its
    ``/scale``); the operator creates it and owns everything but ``spec.replicas`` (see scaling.py)."""
    scale = {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [
        {"name": "Deployment", "type": "string", "jsonPath": ".spec.deployment"},
        {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Effective", "type": "integer", "jsonPath": ".status.effectiveReplicas"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    description = (
        "One role of a DisaggregatedDeployment, for autoscalers: spec.replicas (its /scale) is the desired engine "
        "count; the operator runs it within the deployment's bounds."
    )
    subresources = {"status": {}, "scale": scale}
    version = _version(subresources, columns, description, _role_spec_schema(), _role_status_schema())
    return _definition(ROLE_KIND, ROLE_PLURAL, ["ddrole"], version)


def crds() -> list[dict[str, Any]]:
    return [crd(), role_crd()]


HEADER = "# Generated by `kvbridge crd` from the pydantic models in kvbridge_operator; do not edit.\n"


def render_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=100, allow_unicode=True)


def render_role_yaml() -> str:
    return HEADER + yaml.safe_dump(role_crd(), sort_keys=False, width=100, allow_unicode=True)


def files() -> dict[str, str]:
    """Every CRD by its file name (``kvbridge crd -o DIR``, the chart's crds/)."""
    return {FILE_NAME: render_yaml(), ROLE_FILE_NAME: render_role_yaml()}
