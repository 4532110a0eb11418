"""What a :class:`~kvbridge_router.proxy.Router` runs with: the settings (the operator's api's ``router_settings``,
their defaults written there) as the proxy uses them, and the bounds that are not flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbridge_operator.api.router_settings import DEFAULTS, RouterSettings
from kvbridge_router.admission import Limits
from kvbridge_router.auth import ApiKeys

#: streaming decode: the longest wait for the next chunk (no longer than the decode timeout)
DECODE_IDLE_SECONDS = 60.0


@dataclass(frozen=True)
class RouterConfig:
    """What a router runs with: the settings as the proxy uses them, and the bounds that are not flags."""

    prefill_timeout: float = DEFAULTS.prefill_timeout
    #: a pod's first call of a kind of request (warmth.py): its bound instead of prefill_timeout, and instead of a
    #: stream's decode_idle_timeout until the first chunk
    cold_timeout: float = DEFAULTS.cold_timeout
    decode_timeout: float = DEFAULTS.decode_timeout
    #: streaming decode: the longest wait for the next chunk
    decode_idle_timeout: float = DECODE_IDLE_SECONDS
    connect_timeout: float = 3.0
    prefill_attempts: int = DEFAULTS.prefill_attempts
    #: decode calls per request (the first and its retries on other pairs)
    decode_attempts: int = DEFAULTS.decode_attempts
    #: how pods are chosen (policies/): kv-aware (by the prompt prefix each pod was sent, then load), least-loaded or
    #: round-robin
    policy: str = DEFAULTS.policy.value
    #: kv-aware: tokens per prompt chunk scored, the prefill pods' KV block size (vLLM caches whole blocks)
    block_tokens: int = DEFAULTS.block_size
    #: kv-aware: the router replicas in front of the pool (each scales its counts of requests in flight by it)
    replicas: int = DEFAULTS.replicas
    #: the whole request, every prefill and decode call and retry included
    request_timeout: float = DEFAULTS.request_timeout
    max_body_bytes: int = 16 << 20
    #: seconds a request's body may take to arrive (a client that stalls gets 408)
    body_timeout: float = DEFAULTS.body_timeout
    #: seconds a request's head may take to arrive, from the connection's opening or the head's first byte (a client
    #: that sends nothing or half a head is disconnected)
    header_timeout: float = DEFAULTS.header_timeout
    #: the largest prefill answer, and decode answer when not streamed, read whole (streams are passed on as they come)
    max_answer_bytes: int = 16 << 20
    #: the router's token (--transfer-token-file): set, decode's kv_transfer_params carry its signature
    transfer_token: bytes = field(default=b"", repr=False)
    #: the clients' API keys (--api-key-file, auth.py): set, /v1/ requests without one are answered 401
    api_keys: ApiKeys | None = field(default=None, repr=False)
    #: the other router replicas (--peers, peering.py): set, this one reports to them and takes their reports
    peers: str = DEFAULTS.peers
    peer_interval: float = DEFAULTS.peer_interval
    #: the key reports are signed with (--peer-key-file)
    peer_key: bytes = field(default=b"", repr=False)

    @classmethod
    def of(
        cls,
        settings: RouterSettings,
        transfer_token: bytes = b"",
        api_keys: ApiKeys | None = None,
        peer_key: bytes = b"",
    ) -> RouterConfig:
        """The configuration ``settings`` give, with the token read from their ``transfer_token_file``, the keys
        of their ``api_key_file`` and the peers' key of their ``peer_key_file``."""
        return cls(
            prefill_timeout=settings.prefill_timeout,
            cold_timeout=settings.cold_timeout,
            decode_timeout=settings.decode_timeout,
            decode_idle_timeout=min(settings.decode_timeout, DECODE_IDLE_SECONDS),
            prefill_attempts=settings.prefill_attempts,
            decode_attempts=settings.decode_attempts,
            request_timeout=settings.request_timeout,
            body_timeout=settings.body_timeout,
            header_timeout=settings.header_timeout,
            policy=settings.policy.value,
            block_tokens=settings.block_size,
            replicas=settings.replicas,
            transfer_token=transfer_token,
            api_keys=api_keys,
            peers=settings.peers,
            peer_interval=settings.peer_interval,
            peer_key=peer_key,
        )

    @property
    def limits(self) -> Limits:
        return Limits(self.max_body_bytes, self.body_timeout)
