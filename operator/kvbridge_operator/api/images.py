"""Engine images: which ones carry kvbridge's vLLM connector, and kvbridge's own engine image.

``connector: KVBridge`` has vLLM load ``kvbridge_agent.vllm_connector`` from the engine's image. vLLM's own
published images do not contain kvbridge, so an engine started from one fails at start-up on every pod (vLLM
cannot import the connector's module), after pulling an image of several GB: a certain failure, refused before
anything is scheduled (the spec's model check, and the CRD's rule of the same regular expression at
``kubectl apply``). Any other image may carry kvbridge; it is taken as written.
"""

from __future__ import annotations

import re
from typing import Any

from kvbridge_operator.api.names import ENGINE_CONTAINER

#: kvbridge's vLLM engine image: vLLM with kvbridge installed; the operator's default for ``connector: KVBridge``
#: (``:<version>`` on GPUs, from images/vllm-engine/Dockerfile; ``:<version>-cpu`` on vLLM's CPU build, from
#: images/vllm-engine-cpu/Dockerfile)
KVBRIDGE_ENGINE_REPOSITORY = "ghcr.io/kvbridge/vllm-engine"
#: vLLM's own published images, which do not contain kvbridge (Docker Hub's, and vLLM's public ECR builds)
STOCK_VLLM_REPOSITORIES = (
    "vllm/vllm-openai",
    "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo",
    "public.ecr.aws/q9t5s3a7/vllm-release-repo",
)
#: a stock vLLM image, with or without Docker Hub's registry, with any tag or digest (the CRD's rule uses it too)
STOCK_VLLM_PATTERN = (
    r"^((docker\.io|index\.docker\.io|registry-1\.docker\.io)/)?("
    + "|".join(name.replace(".", r"\.") for name in STOCK_VLLM_REPOSITORIES)
    + r")([:@].*)?$"
)
_STOCK = re.compile(STOCK_VLLM_PATTERN)
#: the code of the refusal
IMAGE_LACKS_CONNECTOR = "IMAGE_LACKS_CONNECTOR"


def lacks_connector(image: str) -> bool:
    """Whether ``image`` is one of vLLM's own images, which cannot load kvbridge's connector."""
    return bool(_STOCK.match(image))


def overlay_image(template: dict[str, Any]) -> str:
    """The image a role's pod template overlay sets on the engine container (it wins over ``spec.engine.image``),
    else empty."""
    spec = template.get("spec")
    for container in (spec.get("containers") if isinstance(spec, dict) else None) or []:
        if isinstance(container, dict) and container.get("name") == ENGINE_CONTAINER:
            image = container.get("image")
            return image if isinstance(image, str) else ""
    return ""


def lacks_connector_message(image: str, field: str) -> str:
    """Why ``image`` (set at ``field``) is refused with ``connector: KVBridge``, and what to set instead."""
    where = "" if field == "spec.engine.image" else "the engine container's image "
    return (
        f"{where}{image[:120]!r} is one of vLLM's own images, which do not contain kvbridge: vLLM could not load "
        "kvbridge's connector (kvbridge_agent.vllm_connector) and every pod would fail at start-up. Use kvbridge's "
        f"engine image ({KVBRIDGE_ENGINE_REPOSITORY}, built from images/vllm-engine/Dockerfile: docs/install.md) or "
        "an image of your own with kvbridge installed, or remove the image for the operator's default (kvbridge's "
        "engine image); or set spec.engine.connector: Nixl"
    )
