"""Decode's bounds on transfer parameters (core/admission.py): the prefill hosts' allow-list as a parser and a
matcher (properties over addresses, networks, names and any text), and the deployment's bounds on tokens and block
ids."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvbridge_agent.core import ModelGeometry, RoleSettings
from kvbridge_agent.core.admission import (
    INVALID_TRANSFER_PARAMS,
    REMOTE_HOST_NOT_ALLOWED,
    Admission,
    PrefillHosts,
    TransferRefusedError,
    host_entry_problem,
    service_problem,
    under_service,
)
from kvbridge_agent.core.contract import EngineEnvironment, parse_environment, render_environment
from kvbridge_agent.core.errors import SpecError
from kvbridge_agent.core.handshake import KVTransferParams
from kvbridge_agent.core.plan import PeerTensorParallel

MODEL = ModelGeometry(name="m", num_layers=2, num_kv_heads=2, head_dim=64)
LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
NAME = st.lists(LABEL, min_size=1, max_size=4).map(".".join)
V4 = st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address)
V6 = st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)
NETWORK = st.one_of(
    st.tuples(V4, st.integers(0, 32)).map(lambda t: ipaddress.ip_network(f"{t[0]}/{t[1]}", strict=False)),
    st.tuples(V6, st.integers(0, 128)).map(lambda t: ipaddress.ip_network(f"{t[0]}/{t[1]}", strict=False)),
)


@given(address=V4 | V6, network=NETWORK)
def test_an_address_is_admitted_exactly_when_a_network_entry_holds_it(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, network: ipaddress.IPv4Network | ipaddress.IPv6Network
) -> None:
    hosts = PrefillHosts([str(network)])
    assert hosts.admits(str(address)) == (address.version == network.version and address in network)


@given(entry=NAME, prefix=st.lists(LABEL, max_size=3).map(".".join), other=NAME)
def test_a_name_is_admitted_by_an_entry_it_equals_or_lies_under_and_no_other(
    entry: str, prefix: str, other: str
) -> None:
    under = f"{prefix}.{entry}" if prefix else entry
    assume(not any(map(_is_address, (entry, other, under))))  # 0.0.0.0 is an address, not a name under 0
    hosts = PrefillHosts([entry])
    assert hosts.admits(under)
    assert hosts.admits(under.upper() + ".")  # DNS names are case-insensitive; a trailing dot is the root
    assert hosts.admits(other) == (other == entry or other.endswith("." + entry))
    assert not hosts.admits(f"{entry}.evil")  # an entry is a suffix of whole labels, at the end only
    assert not hosts.admits(f"x{entry}")


@given(host=st.text(max_size=60), entries=st.lists(st.text(max_size=30), max_size=4))
def test_any_text_is_either_an_entry_or_refused_and_matching_never_raises(host: str, entries: list[str]) -> None:
    for entry in entries:
        problem = host_entry_problem(entry)
        if problem:
            with pytest.raises(ValueError, match="neither an IP address"):
                PrefillHosts([entry])
    valid = [e for e in entries if not host_entry_problem(e)]
    hosts = PrefillHosts(valid)
    admitted = hosts.admits(host)
    assert isinstance(admitted, bool)
    if not valid:
        assert admitted  # no entries: the deployment did not say where its prefill pods are


@given(address=V4 | V6, name=NAME)
def test_no_name_matches_a_network_and_no_address_a_name(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, name: str
) -> None:
    """Nothing is resolved: a name is admitted by name entries only, an address by networks only."""
    assume(not _is_address(name))
    assert not PrefillHosts(["0.0.0.0/0", "::/0"]).admits(name)
    assert not PrefillHosts([name]).admits(str(address))


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    ("host", "admitted"),
    [
        ("10.1.2.3", True),
        ("fd00::1", True),
        ("p-0.dd-prefill.ns.svc.cluster.local", True),
        ("127.0.0.1", False),
        ("169.254.169.254", False),  # a cloud's metadata service
        ("::ffff:10.1.2.3", False),  # an IPv4-mapped address is an IPv6 address: not in 10.0.0.0/8
        ("0.0.0.0", False),
        ("dd-prefill.ns.svc.cluster.local.evil.com", False),
        ("xdd-prefill.ns.svc.cluster.local", False),
        ("2130706433", False),  # 127.0.0.1 as one number: a name to the schema, under no entry
    ],
)
def test_what_a_deployment_s_prefill_hosts_admit(host: str, admitted: bool) -> None:
    hosts = PrefillHosts(["10.0.0.0/8", "fd00::/8", "dd-prefill.ns.svc.cluster.local"])
    assert hosts.admits(host) is admitted


@pytest.mark.parametrize("entry", ["", "10.0.0.0/33", "10.0.0.1/8/1", "a b", "-bad", "*.svc", "a..b"])
def test_entries_that_are_not_addresses_networks_or_names_are_refused(entry: str) -> None:
    assert host_entry_problem(entry)


def test_the_environment_carries_the_prefill_hosts_comma_separated() -> None:
    env = EngineEnvironment(
        role="decode",
        engine_id="d-0",
        model=MODEL,
        prefill=RoleSettings(),
        decode=RoleSettings(),
        prefill_hosts=["10.0.0.0/8", "dd-prefill.ns.svc"],
    )
    rendered = render_environment(env)
    assert rendered["KVBRIDGE_PREFILL_HOSTS"] == "10.0.0.0/8,dd-prefill.ns.svc"
    assert parse_environment(rendered).prefill_hosts == ["10.0.0.0/8", "dd-prefill.ns.svc"]
    unset = render_environment(env.model_copy(update={"prefill_hosts": None}))
    assert "KVBRIDGE_PREFILL_HOSTS" not in unset  # not rendered: pods that do not use it keep their environment
    assert parse_environment({**unset, "KVBRIDGE_PREFILL_HOSTS": " "}).prefill_hosts == []
    with pytest.raises(SpecError) as caught:
        parse_environment({**rendered, "KVBRIDGE_PREFILL_HOSTS": "10.0.0.0/8,not a host"})
    assert caught.value.field == "KVBRIDGE_PREFILL_HOSTS"


def params(**changes: object) -> KVTransferParams:
    fields: dict[str, object] = {
        "remote_engine_id": "p-0",
        "remote_incarnation": "i",
        "remote_host": "10.1.2.3",
        "remote_port": 5600,
        "remote_request_id": "r",
        "remote_block_ids": [0, 1, 2],
        "num_tokens": 70,
        "remote_tp_size": 1,
        "fingerprint": "f",
    }
    return KVTransferParams(**{**fields, **changes})


ADMISSION = Admission(
    PeerTensorParallel(MODEL, RoleSettings(block_size=32), RoleSettings(block_size=32), None),
    max_tokens=4096,
    wire_block_size=32,
    hosts=PrefillHosts(["10.0.0.0/8"]),
)


@pytest.mark.parametrize(
    ("changes", "code", "field"),
    [
        ({"num_tokens": 4097, "remote_block_ids": list(range(129))}, INVALID_TRANSFER_PARAMS, "numTokens"),
        ({"num_tokens": 1 << 24}, INVALID_TRANSFER_PARAMS, "numTokens"),
        ({"remote_block_ids": [0, 1, 2, 3]}, INVALID_TRANSFER_PARAMS, "remoteBlockIds"),
        ({"remote_block_ids": list(range(1 << 20))}, INVALID_TRANSFER_PARAMS, "remoteBlockIds"),
        (
            {"remote_block_ids": [0, 1, 2, 3, 4], "remote_group_sizes": [1, 4]},
            INVALID_TRANSFER_PARAMS,
            "remoteBlockIds",
        ),
        ({"remote_tp_size": 3}, INVALID_TRANSFER_PARAMS, "remoteTpSize"),
        ({"remote_host": "127.0.0.1"}, REMOTE_HOST_NOT_ALLOWED, "remoteHost"),
    ],
)
def test_parameters_past_the_deployment_s_bounds_are_refused_naming_the_field(
    changes: dict[str, object], code: str, field: str
) -> None:
    with pytest.raises(TransferRefusedError) as caught:
        ADMISSION.check(params(**changes), "kvTransferParams")
    assert (caught.value.code, caught.value.field) == (code, f"kvTransferParams.{field}")


@given(tokens=st.integers(1, 4096), groups=st.integers(1, 3))
def test_parameters_within_the_bounds_are_admitted(tokens: int, groups: int) -> None:
    fill = -(-tokens // 32)
    ids = list(range(fill * groups))
    sizes = [fill] * groups if groups > 1 else None
    ADMISSION.check(params(num_tokens=tokens, remote_block_ids=ids, remote_group_sizes=sizes), "p")
    ADMISSION.check(params(num_tokens=tokens, remote_block_ids=ids[:fill], remote_group_sizes=None), "p")


# -- the prefill Service's name (KVBRIDGE_PREFILL_SERVICE): what may name it, what lies under it ----------------


@given(service=NAME, prefix=st.lists(LABEL, min_size=1, max_size=3).map(".".join), other=NAME)
def test_a_name_lies_under_the_service_exactly_when_it_ends_in_a_label_boundary_before_it(
    service: str, prefix: str, other: str
) -> None:
    assume(not any(map(_is_address, (service, other, f"{prefix}.{service}"))))
    assert under_service(f"{prefix}.{service}", service)
    assert under_service(f"{prefix}.{service}".upper() + ".", service + ".")  # case and the root's dot aside
    assert not under_service(service, service)  # the Service names every prefill pod, not one
    assert not under_service(f"{prefix}.{service}.evil", service)
    assert not under_service(f"x{service}", service)
    assert under_service(other, service) == other.endswith("." + service)


@given(address=V4 | V6, service=NAME)
def test_no_address_lies_under_a_service(address: ipaddress.IPv4Address | ipaddress.IPv6Address, service: str) -> None:
    assert not under_service(str(address), service)


@given(text=st.text(max_size=80))
def test_the_service_is_named_by_a_dns_name_only_and_any_text_gets_an_answer(text: str) -> None:
    problem = service_problem(text)  # never raises
    assert (problem == "") == (not _is_address(text) and host_entry_problem(text) == "" and "/" not in text)


@pytest.mark.parametrize("value", ["10.0.0.1", "fd00::1", "10.0.0.0/8", "a..b", "-x.svc", "a b"])
def test_the_environment_refuses_a_prefill_service_that_is_no_dns_name(value: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_environment({**render_environment(_decode_env()), "KVBRIDGE_PREFILL_SERVICE": value})
    assert caught.value.field == "KVBRIDGE_PREFILL_SERVICE"


def test_the_environment_carries_the_prefill_service_and_empty_is_unset() -> None:
    rendered = render_environment(_decode_env(prefill_service="dd-prefill.ns.svc"))
    assert rendered["KVBRIDGE_PREFILL_SERVICE"] == "dd-prefill.ns.svc"
    assert parse_environment(rendered).prefill_service == "dd-prefill.ns.svc"
    assert parse_environment({**rendered, "KVBRIDGE_PREFILL_SERVICE": " "}).prefill_service is None
    assert "KVBRIDGE_PREFILL_SERVICE" not in render_environment(_decode_env())


def _decode_env(**changes: object) -> EngineEnvironment:
    return EngineEnvironment.model_validate(
        {
            "role": "decode",
            "engine_id": "d-0",
            "model": MODEL,
            "prefill": RoleSettings(),
            "decode": RoleSettings(),
            **changes,
        }
    )
