"""Checks the API server would do on a custom resource: structural defaulting, schema, CEL rules."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema
from celpy.adapter import json_to_cel


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Kubernetes structural defaulting: fill absent properties that have a default, recursively."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        if isinstance(value, list) and "items" in schema:
            return [apply_defaults(schema["items"], item) for item in value]
        return value
    result = dict(value)
    for name, sub in schema.get("properties", {}).items():
        if name not in result and "default" in sub:
            result[name] = copy.deepcopy(sub["default"])
        if name in result:
            result[name] = apply_defaults(sub, result[name])
    return result


def schema_errors(schema: dict[str, Any], value: Any) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)  # OpenAPI v3.0: boolean exclusiveMinimum
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(value)]


def cel_failures(rules: list[dict[str, str]], spec: dict[str, Any]) -> list[dict[str, str]]:
    """The rules (``x-kubernetes-validations``) that a defaulted spec violates."""
    environment = celpy.Environment()
    failed = []
    for rule in rules:
        program = environment.program(environment.compile(rule["rule"]))
        result = program.evaluate({"self": json_to_cel(spec)})
        if result != celpy.celtypes.BoolType(True):
            failed.append(rule)
    return failed
