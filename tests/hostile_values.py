"""What a client or a faulty peer can put into what crosses a process boundary: JSON of any shape, numbers around
every bound, and kvbridge's transfer parameters with some fields replaced (tests/agent/*/test_hostile_input.py).

Hosts are loopback or not an address at all, and ports are the caller's (its prefill's, a refused one) or invalid:
a fuzz built on these never leaves the machine nor reaches another test's server.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

#: loopback, or what the schema refuses before any name is resolved (a name that would be looked up on the network,
#: such as 999.1.1.1, is never drawn)
HOSTS = ["127.0.0.1", "localhost", "::1", "", "x" * 300, "a b", "-bad", "\x00"]
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 3, 4, 1023, 1024, 1025, 10**9, 1 << 24, (1 << 24) + 1, 2**31, 2**63, 2**64]),
)
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=24,
)
BLOCK_IDS = st.one_of(
    st.lists(NUMBERS, max_size=64),
    st.lists(st.integers(0, 40), min_size=0, max_size=12),  # within and past prefill's 24 blocks
    st.integers(0, 200_000).map(lambda n: list(range(n))),  # up to 200,000 ids
    JSON,
)


def fields(pair_ports: tuple[int, int]) -> dict[str, st.SearchStrategy[Any]]:
    """Values of the right type for each of kvbridge's fields, most of them wrong (any JSON is drawn besides)."""
    port, refused = pair_ports
    return {
        "remoteEngineId": st.sampled_from(["prefill-hostile", "another", "", "x" * 300]),
        "remoteIncarnation": st.sampled_from(["stale", "", "x" * 100]),
        "remoteHost": st.sampled_from(HOSTS),
        "remotePort": st.sampled_from([port, refused, 0, -1, 65536, 2**40]),
        "remoteRequestId": st.sampled_from(["p1", "p999", "a:b", "", "x" * 300]),
        "remoteBlockIds": BLOCK_IDS,
        "remoteGroupSizes": st.lists(NUMBERS, max_size=70),
        "numTokens": NUMBERS,
        "remoteTpSize": NUMBERS,
        "fingerprint": st.sampled_from(["", "ffffffff", "x" * 70]),
        "expiresAt": NUMBERS | st.floats(),
        "verify": st.booleans(),
        "leaseToken": st.sampled_from(["", "0" * 32, "x" * 65]),
        "digests": st.fixed_dictionaries(
            {"key": st.sampled_from(["00" * 16, "zz"]), "heads": st.lists(NUMBERS, max_size=5), "rows": st.text()}
        ),
        "somethingElse": JSON,
    }


@st.composite
def hostile_params(draw: st.DrawFn, real: dict[str, Any], ports: tuple[int, int], envelope: bool = True) -> Any:
    """The real parameters of a fresh request with some of kvbridge's fields (or the envelope) replaced;
    ``envelope``: kvbridge's fields sit under ``"kvbridge"`` in vLLM's ``kv_transfer_params`` (else they are the
    parameters, as the synthetic engine takes them)."""
    params = json.loads(json.dumps(real))
    ours = params["kvbridge"] if envelope else params
    choices = fields(ports)
    how = draw(st.sampled_from(["fields", "fields", "fields", "fields", "envelope", "anything"]))
    if how == "anything":
        return draw(JSON)
    if how == "envelope":
        params[draw(st.sampled_from(["kvbridge", "do_remote_prefill", "other"]))] = draw(JSON)
        return params
    if draw(st.booleans()):  # an incarnation decode has not met: it handshakes (with what the parameters claim)
        ours["remoteIncarnation"] = "unmet"
    for name in draw(st.lists(st.sampled_from(sorted(choices)), min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 5)) == 0 and name in ours:
            del ours[name]
        else:
            ours[name] = draw(choices[name] if draw(st.integers(0, 3)) else JSON)
    return params
