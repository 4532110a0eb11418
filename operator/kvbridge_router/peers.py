"""What router replicas tell each other, and what one makes of it; pure (no HTTP library).

A replica sees only the requests it routes: about ``1/R`` of each pod's load, and of the prompts each pod was sent.
Measured in the simulated pool (docs/benchmarks.md), each half of that blindness costs about as much TTFT as the
other, so a replica reports both, every ``--peer-interval``, to every other replica (peering.py sends them):

- its **requests in flight per pod** (what :class:`~kvbridge_router.pool.Balancer` counts);
- **what it sent** since its last report: each pod and the prefix keys of the prompt sent to it (what
  :class:`~kvbridge_router.prefixes.PrefixIndex` records): a decode pod as chosen, a prefill pod once its prefill
  was computed.

A report is a binary frame (:func:`encode`, :func:`decode`), little-endian, signed with HMAC-SHA256 under the key
the replicas share (the ``<name>-router-peers`` Secret's)::

    b"KVBP" | version u8 | replica id 16 bytes | sequence u64 | sent at u64 (milliseconds since the epoch)
    | pods u16 | per pod: name length u16, UTF-8 name
    | in flight u32 per pod (in the table's order)
    | records u32 | pod index u16 per record | keys u16 per record | the keys, int64 each, records in order
    | HMAC-SHA256 of all the above (32 bytes)

Anything else is a :class:`PeerFrameError` with a stable code (counted by the receiver, never raised further): a
frame cut short or with bytes left over, a bad signature, an unknown version, a pod index out of the table, more
pods, records or keys than the bounds below. :class:`PeerView` keeps the newest report of each replica (older
sequence numbers are dropped) while it is fresh (``fresh`` seconds), at most :data:`MAX_PEERS` replicas; its
:meth:`~PeerView.loads` is the sum of the fresh reports' counts. A report sent more than :data:`REPLAY_SECONDS` from
the receiver's clock is dropped too (peering.py), and each replica's last sequence number is kept that long after
its report went stale, so that a frame captured and sent again later changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

MAGIC = b"KVBP"
#: 2: prefix keys of token-id prompts read from their text (prefixes.py); a replica of another version is refused
VERSION = 2
ID_BYTES = 16
MAC_BYTES = 32
#: the most pods one report names (the pool's, at most)
MAX_PODS = 4096
#: the most records one report carries (prompts sent since the last report, two pods each)
MAX_RECORDS = 65535
#: the most keys one record carries (prefixes.MAX_CHUNKS)
MAX_KEYS = 4096
#: the most replicas whose reports are kept (more are ignored until one goes stale)
MAX_PEERS = 64
#: a report's size at most, whatever it holds (a replica reports at most pool.SENT_KEYS keys, 2 MiB of them)
MAX_FRAME_BYTES = 4 << 20
#: a report sent further than this from the receiver's clock (seconds, either way) is not taken: a replay
REPLAY_SECONDS = 10.0
#: what the signature covers besides the frame: a key given for another use (a transfer token, say) never signs a
#: report that verifies
_DOMAIN = b"kvbridge-router-peers\x00"

_HEAD = struct.Struct(f"<4sB{ID_BYTES}sQQH")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


class PeerFrameError(ValueError):
    """A report that is not one: ``code`` says what is wrong with it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class Report:
    """One replica's report: its id (new on every start), its sequence number, when it was sent (milliseconds since
    the epoch), its requests in flight per pod, and the pods it sent prompts since its last report with their prefix
    keys."""

    replica: bytes
    sequence: int
    loads: Mapping[str, int]
    sent: Sequence[tuple[str, Sequence[int]]] = ()
    sent_at_ms: int = 0


def _mac(key: bytes, data: bytes | memoryview) -> bytes:
    signer = hmac.new(key, _DOMAIN, hashlib.sha256)
    signer.update(data)  # not copied
    return signer.digest()


def encode(report: Report, key: bytes) -> bytes:
    """``report`` as a signed frame; raises ``ValueError`` where it passes a bound (a caller's bug)."""
    if len(report.replica) != ID_BYTES:
        raise ValueError(f"a replica id is {ID_BYTES} bytes")
    names = list(dict.fromkeys([*report.loads, *(pod for pod, _ in report.sent)]))
    if len(names) > MAX_PODS or len(report.sent) > MAX_RECORDS:
        raise ValueError(f"a report names at most {MAX_PODS} pods and carries at most {MAX_RECORDS} records")
    index = {name: i for i, name in enumerate(names)}
    parts = [_HEAD.pack(MAGIC, VERSION, report.replica, report.sequence, report.sent_at_ms, len(names))]
    for name in names:
        data = name.encode()
        parts += [_U16.pack(len(data)), data]
    parts.append(np.array([report.loads.get(n, 0) for n in names], dtype="<u4").tobytes())
    parts.append(_U32.pack(len(report.sent)))
    parts.append(np.array([index[pod] for pod, _ in report.sent], dtype="<u2").tobytes())
    counts = [min(len(keys), MAX_KEYS) for _, keys in report.sent]
    parts.append(np.array(counts, dtype="<u2").tobytes())
    keys = [k for (_, ks), n in zip(report.sent, counts, strict=True) for k in ks[:n]]
    parts.append(np.array(keys, dtype="<i8").tobytes())
    body = b"".join(parts)
    return body + _mac(key, body)


def decode(frame: bytes, key: bytes) -> Report:
    """The report a frame holds, its signature checked first; :class:`PeerFrameError` for anything else."""
    if len(frame) > MAX_FRAME_BYTES:
        raise PeerFrameError("TOO_LARGE", f"{len(frame)} bytes, over {MAX_FRAME_BYTES}")
    if len(frame) < _HEAD.size + MAC_BYTES:
        raise PeerFrameError("TRUNCATED", f"{len(frame)} bytes, shorter than a report's head")
    body, mac = memoryview(frame)[:-MAC_BYTES], frame[-MAC_BYTES:]
    if not hmac.compare_digest(_mac(key, body), mac):
        raise PeerFrameError("BAD_SIGNATURE", "not signed with this deployment's router key")
    magic, version, replica, sequence, sent_at_ms, pods = _HEAD.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        raise PeerFrameError(
            "VERSION", f"magic {magic!r} version {version}: not a kvbridge report of version {VERSION}"
        )
    if pods > MAX_PODS:
        raise PeerFrameError("TOO_MANY_PODS", f"{pods} pods, over {MAX_PODS}")
    at = _HEAD.size
    try:
        names = []
        for _ in range(pods):
            (size,) = _U16.unpack_from(body, at)
            names.append(bytes(body[at + 2 : at + 2 + size]).decode())
            at += 2 + size
            if at > len(body):
                raise PeerFrameError("TRUNCATED", "a pod name runs past the frame")
        loads = np.frombuffer(body, dtype="<u4", count=pods, offset=at)
        at += 4 * pods
        (records,) = _U32.unpack_from(body, at)
        at += 4
        if records > MAX_RECORDS:
            raise PeerFrameError("TOO_MANY_RECORDS", f"{records} records, over {MAX_RECORDS}")
        where = np.frombuffer(body, dtype="<u2", count=records, offset=at)
        counts = np.frombuffer(body, dtype="<u2", count=records, offset=at + 2 * records)
        at += 4 * records
        total = int(counts.sum())
        keys = np.frombuffer(body, dtype="<i8", count=total, offset=at).tolist()
        at += 8 * total
    except PeerFrameError:
        raise
    except UnicodeDecodeError:  # (a ValueError too)
        raise PeerFrameError("BAD_NAME", "a pod name is not UTF-8") from None
    except (struct.error, ValueError) as exc:  # numpy: "buffer is smaller than requested size"
        raise PeerFrameError("TRUNCATED", f"the frame ends early ({exc})") from None
    if at != len(body):
        raise PeerFrameError("TRAILING_BYTES", f"{len(body) - at} bytes after the report")
    if records and int(where.max()) >= pods:
        raise PeerFrameError("BAD_POD_INDEX", f"a record names pod {int(where.max())} of {pods}")
    if records and int(counts.max()) > MAX_KEYS:
        raise PeerFrameError("TOO_MANY_KEYS", f"a record holds {int(counts.max())} keys, over {MAX_KEYS}")
    ends = np.cumsum(counts).tolist()
    sent = [
        (names[pod], keys[end - count : end])
        for pod, count, end in zip(where.tolist(), counts.tolist(), ends, strict=True)
    ]
    loads_by_pod = dict(zip(names, loads.tolist(), strict=True))
    return Report(bytes(replica), int(sequence), loads_by_pod, sent, int(sent_at_ms))


@dataclass
class PeerView:
    """The other replicas' newest reports, while fresh: this replica's view of what they route."""

    me: bytes
    #: seconds a report stands for its replica (then it is dropped: a replica that stopped, or cannot reach us)
    fresh: float
    _reports: dict[bytes, tuple[float, Report]] = field(default_factory=dict)
    #: each replica's last sequence number, and when it was taken, kept REPLAY_SECONDS past its report (bounded)
    _sequences: dict[bytes, tuple[int, float]] = field(default_factory=dict)

    def accept(self, report: Report, now: float) -> bool:
        """Keep ``report`` if it is another replica's and newer than what it said before; whether it was kept."""
        if report.replica == self.me:
            return False
        self._expire(now)
        last = self._sequences.get(report.replica)
        if last is not None and last[0] >= report.sequence:
            return False
        if report.replica not in self._reports and len(self._reports) >= MAX_PEERS:
            return False
        self._reports[report.replica] = (now, report)
        self._sequences[report.replica] = (report.sequence, now)
        if len(self._sequences) > 4 * MAX_PEERS:  # replicas come and go: the oldest first
            del self._sequences[min(self._sequences, key=lambda r: self._sequences[r][1])]
        return True

    def loads(self, now: float) -> tuple[dict[str, int], int]:
        """The fresh reports' requests in flight per pod, summed, and how many replicas they are from."""
        self._expire(now)
        total: dict[str, int] = {}
        for _, report in self._reports.values():
            for pod, count in report.loads.items():
                total[pod] = total.get(pod, 0) + count
        return total, len(self._reports)

    def replicas(self, now: float) -> Iterable[bytes]:
        self._expire(now)
        return tuple(self._reports)

    def _expire(self, now: float) -> None:
        for replica in [r for r, (at, _) in self._reports.items() if now - at > self.fresh]:
            del self._reports[replica]
        for replica in [r for r, (_, at) in self._sequences.items() if now - at > self.fresh + REPLAY_SECONDS]:
            del self._sequences[replica]
