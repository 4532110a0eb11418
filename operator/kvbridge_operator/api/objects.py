"""A Kubernetes object as the API's JSON: the one alias the operator, the router and the simulation share."""

from typing import Any

Obj = dict[str, Any]
