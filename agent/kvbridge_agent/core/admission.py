"""What a decode engine admits of a request's transfer parameters beyond their schema (docs/protocol.md §5).

The schema (:class:`~.handshake.KVTransferParams`) bounds every field by what any deployment could send. Decode
then bounds them by what its own deployment allows, before it records anything for the request or opens any
connection: a prefill TP the deployment's verdict accepts, a token count within the model's length, no more block
ids than those tokens fill, and a prefill host among those the deployment names (``KVBRIDGE_PREFILL_HOSTS``).
Anything else fails that one request, typed. Where the deployment names its prefill role's Service
(``KVBRIDGE_PREFILL_SERVICE``), the host must also be one of that Service's addresses: checked where DNS may run, on
the threads that connect (``transfer.peers.PrefillService``), never on vLLM's; :func:`under_service` is its rule
for names.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .arithmetic import ceil_div
from .errors import KVBridgeError
from .handshake import KVTransferParams, host_problem
from .plan import PeerTensorParallel

INVALID_TRANSFER_PARAMS = "INVALID_TRANSFER_PARAMS"
#: the parameters name a side channel outside the deployment's prefill hosts: decode does not connect to it
REMOTE_HOST_NOT_ALLOWED = "REMOTE_HOST_NOT_ALLOWED"

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class TransferRefusedError(KVBridgeError):
    """Transfer parameters this decode engine does not admit; ``field`` is the parameter's (camelCase) name."""

    code = INVALID_TRANSFER_PARAMS


def host_entry_problem(entry: str) -> str:
    """Why ``entry`` cannot be an entry of the prefill hosts (empty when it can): an IP address, a network in CIDR
    notation (``10.0.0.0/8``, ``fd00::/8``) or a DNS name (which admits itself and every name under it)."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_network(entry, strict=False)
        return ""
    if not host_problem(entry):
        return ""
    return f"{entry!r} is neither an IP address, a network in CIDR notation nor a DNS name"


def service_problem(name: str) -> str:
    """Why ``name`` cannot name the prefill role's Service (empty when it can): a DNS name, not an address."""
    if _is_address(name) or host_problem(name):
        return f"{name!r} is not a DNS name (the prefill role's Service: <deployment>-prefill.<namespace>.svc)"
    return ""


def under_service(host: str, service: str) -> bool:
    """Whether the DNS name ``host`` lies under the Service's name ``service`` (a pod's name under its headless
    Service: ``p-0.dd-prefill.ns.svc`` under ``dd-prefill.ns.svc``); the Service's own name is not under it (it names
    every prefill pod, not one), nor is an address."""
    if _is_address(host):
        return False
    return host.removesuffix(".").lower().endswith("." + service.removesuffix(".").lower())


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class PrefillHosts:
    """The hosts a decode engine may open side channels to (``KVBRIDGE_PREFILL_HOSTS``): an address admitted by a
    network entry that holds it, a name by a DNS name entry it equals or lies under (``p-0.dd-prefill.ns.svc``
    under ``dd-prefill.ns.svc``). No name is resolved: an address never matches a name entry, nor a name a network.
    Without entries every host is admitted (the deployment did not say where its prefill pods are)."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self.entries = tuple(entries)
        self._networks: list[IPNetwork] = []
        self._names: list[str] = []
        for entry in self.entries:
            problem = host_entry_problem(entry)
            if problem:
                raise ValueError(problem)
            try:
                self._networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._names.append(entry.removesuffix(".").lower())

    @property
    def restricted(self) -> bool:
        return bool(self.entries)

    def admits(self, host: str) -> bool:
        if not self.entries:
            return True
        if not _is_address(host):
            name = host.removesuffix(".").lower()
            return any(name == entry or name.endswith("." + entry) for entry in self._names)
        address = ipaddress.ip_address(host)
        return any(address.version == net.version and address in net for net in self._networks)


@dataclass(frozen=True)
class Admission:
    """A decode engine's bounds on transfer parameters: the deployment's prefill TPs (``peer_tp``), the model's
    length in tokens (``max_tokens``; ``None``: the schema's bound), the wire block size (how many block ids a
    token count fills) and the prefill hosts."""

    peer_tp: PeerTensorParallel
    max_tokens: int | None
    wire_block_size: int
    hosts: PrefillHosts

    def check(self, params: KVTransferParams, where: str) -> None:
        """Raise :class:`TransferRefusedError` naming the first field out of this deployment's bounds (its path:
        ``where``, the parameters' own, then the field's name)."""
        if not self.hosts.admits(params.remote_host):
            raise TransferRefusedError(
                f"{params.remote_host!r} is not among the deployment's prefill hosts ({', '.join(self.hosts.entries)}"
                "; KVBRIDGE_PREFILL_HOSTS): decode opens no connection to it",
                field=f"{where}.remoteHost",
                code=REMOTE_HOST_NOT_ALLOWED,
            )
        refusal = self.peer_tp.refusal(params.remote_tp_size)
        if refusal:
            raise TransferRefusedError(refusal, field=f"{where}.remoteTpSize")
        if self.max_tokens is not None and params.num_tokens > self.max_tokens:
            raise TransferRefusedError(
                f"numTokens {params.num_tokens} exceeds the model's length of {self.max_tokens} tokens on this engine",
                field=f"{where}.numTokens",
            )
        fill = ceil_div(params.num_tokens, self.wire_block_size)
        sizes: Sequence[int] = params.remote_group_sizes or [len(params.remote_block_ids)]
        if max(sizes) > fill:
            raise TransferRefusedError(
                f"{max(sizes)} block ids for one cache group, but {params.num_tokens} tokens fill {fill} wire blocks "
                f"of {self.wire_block_size}",
                field=f"{where}.remoteBlockIds",
            )
