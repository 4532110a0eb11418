"""The demo's report: per deployment what ``kubectl get dd`` shows, its conditions, plan, endpoints and the requests
sent through it, the operator's events; as JSON (``--json``) or as text."""

from __future__ import annotations

import json
from typing import Any

from kvbridge_operator.api.objects import Obj
from kvbridge_sim.demo_wait import condition


def ready_columns(obj: Obj) -> dict[str, str]:
    """What `kubectl get dd` shows (the CRD's printer columns)."""
    status = obj.get("status") or {}
    return {
        "ready": condition(obj, "Ready").get("status", ""),
        "available": condition(obj, "Available").get("status", ""),
        "prefill": status.get("prefill", {}).get("ready", ""),
        "decode": status.get("decode", {}).get("ready", ""),
        "tp": status.get("tp", ""),
    }


def conditions_of(obj: Obj) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions") or []}


def entry_of(obj: Obj) -> dict[str, Any]:
    """A deployment's entry as it settled: its columns, conditions, plan and prefill endpoints."""
    status = obj.get("status") or {}
    return {
        "name": obj["metadata"]["name"],
        "ready": ready_columns(obj),
        "conditions": conditions_of(obj),
        "plan": status.get("plan"),
        "endpoints": status.get("prefill", {}).get("endpoints") or [],
    }


def events_of(api: Any, name: str) -> list[Obj]:
    return [
        {
            "object": f"DisaggregatedDeployment/{e['involvedObject']['name']}",
            "type": e["type"],
            "reason": e["reason"],
            "message": e["message"],
        }
        for e in api.objects_of("events")
        if e.get("involvedObject", {}).get("name") == name
    ]


def render_text(report: dict[str, Any]) -> str:
    lines = ["", "NAME                     READY   AVAILABLE   PREFILL   DECODE   TP"]
    for d in report["deployments"]:
        r = d["ready"]
        available = r.get("available", "")
        lines.append(f"{d['name']:<24} {r['ready']:<7} {available:<11} {r['prefill']:<9} {r['decode']:<8} {r['tp']}")
    for d in report["deployments"]:
        lines += _deployment_lines(d)
    lines.append("")
    lines.append("events:")
    for e in report["events"]:
        lines.append(f"  {e['type']:<8} {e['reason']:<17} {e['object']}: {e['message'][:160]}")
    lines.append("")
    lines.append("demo " + ("succeeded" if report["ok"] else "FAILED"))
    return "\n".join(lines)


def _deployment_lines(d: dict[str, Any]) -> list[str]:
    lines = ["", f"{d['name']}: conditions {json.dumps(d['conditions'])}"]
    if d.get("plan"):
        lines.append(f"  plan: {json.dumps(d['plan'])}")
    for e in d["endpoints"]:
        lines.append(
            f"  endpoint {e['pod']} {e['ip']}:{e['port']} ranks={e['ranks']} fingerprint={e['fingerprint']} "
            f"pairing={e.get('pairing', '')}"
        )
    if "transfers" in d:
        lines += _transfer_lines(d["transfers"])
    if "pods" in d:
        lines.append(f"  pods created: {d['pods']}")
    return lines


def _transfer_lines(t: dict[str, Any]) -> list[str]:
    speed = f"{t['gbps']} GB/s" if "gbps" in t else f"{t['meanRequestSeconds']} s per P/D request"
    what = "every byte checked" if t["check"] == "bytes" else "decode's tokens equal a single engine's"
    lines = [
        f"  transfers: {t['verified']}/{t['requests']} verified, {what} "
        f"({t['verifiedAfterPrefillRestart']} after the prefill restart), {speed}"
    ]
    for f in t["failures"]:
        lines.append(f"    FAILED {f['request']}: {f['code']}: {f['message']}")
    if t.get("duringOutage"):
        o = t["duringOutage"]
        said = "answered (another prefill pod)" if o["status"] == 200 else f"HTTP {o['status']} {o['code']}"
        lines.append(f"  a request right after the prefill kill: {said} in {o['seconds']} s")
    if t.get("router"):
        r = t["router"]
        lines.append(
            f"  router: requests {json.dumps(r['requests'])}, prefill retries {r['prefillRetries']}, "
            f"own time {r['meanOverheadMilliseconds']} ms per request"
        )
    return lines
