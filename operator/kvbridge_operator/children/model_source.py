"""Where an engine's weights come from (``spec.model.source``), as vLLM pods load them.

- ``hf://ORG/NAME@REVISION``: ``vllm serve ORG/NAME --revision REVISION`` (weights, config and tokenizer all of
  that revision), the token Secret as ``HF_TOKEN``, the shared cache (a ReadWriteMany claim) as ``HF_HOME``;
- ``pvc://CLAIM/PATH``: the claim mounted read-only at ``/models/CLAIM``, ``vllm serve /models/CLAIM/PATH``.

Either way the engine serves the model under ``spec.model.name`` (``--served-model-name``), which clients and
routers use. Without a source, ``spec.model.name`` is what vLLM loads, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.spec import ModelSpec

PVC_ROOT = "/models"
CACHE_PATH = "/model-cache"
#: vLLM arguments a source decides; extraArgs may not set them when spec.model.source is set
SOURCE_ARGUMENTS = (
    "--revision",
    "--tokenizer-revision",
    "--code-revision",
    "--served-model-name",
    "--download-dir",
    "--tokenizer",
)


@dataclass(frozen=True)
class Weights:
    model: str  # what `vllm serve` loads
    args: list[str] = field(default_factory=list)
    env: list[Obj] = field(default_factory=list)
    volumes: list[Obj] = field(default_factory=list)
    mounts: list[Obj] = field(default_factory=list)


def hf_parts(source: str) -> tuple[str, str]:
    """(repository, revision) of ``hf://ORG/NAME@REVISION`` (revision empty: the default branch, unpinned)."""
    repo, _, rev = source.removeprefix("hf://").partition("@")
    return repo, rev


def pvc_parts(source: str) -> tuple[str, str]:
    claim, _, path = source.removeprefix("pvc://").partition("/")
    return claim, path.strip("/")


def weights(model: ModelSpec) -> Weights:
    if not model.source:
        return Weights(model.name)
    served = ["--served-model-name", model.name]
    if model.source.startswith("pvc://"):
        claim, path = pvc_parts(model.source)
        volume = f"model-{claim}"[:63].rstrip("-")
        return Weights(
            f"{PVC_ROOT}/{claim}/{path}".rstrip("/"),
            served,
            volumes=[{"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            mounts=[{"name": volume, "mountPath": f"{PVC_ROOT}/{claim}", "readOnly": True}],
        )
    repo, revision = hf_parts(model.source)
    args = [*served, *(["--revision", revision, "--tokenizer-revision", revision] if revision else [])]
    env: list[Obj] = []
    volumes: list[Obj] = []
    mounts: list[Obj] = []
    if model.token_secret is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": model.token_secret.name, "key": model.token_secret.key}},
            }
        )
    if model.cache is not None:
        env.append({"name": "HF_HOME", "value": CACHE_PATH})
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {"claimName": model.cache.claim_name}})
        mounts.append({"name": "model-cache", "mountPath": CACHE_PATH})
    return Weights(repo, args, env, volumes, mounts)
