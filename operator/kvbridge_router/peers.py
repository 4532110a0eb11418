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
pods, records or keys than the bounds below. A frame is checked whole when decoded; its records' keys are read from
it only as they are used (:class:`Records`), so that a receiver can take a large report a slice at a time.

:class:`PeerView` keeps the newest report of each replica while it is fresh (``fresh`` seconds), at most
:data:`MAX_PEERS` replicas; its :meth:`~PeerView.loads` is the sum of the fresh reports' counts. It takes a report
(:meth:`~PeerView.admit`) only if it was sent at most :data:`REPLAY_SECONDS` before the receiver's clock and at most
:data:`MAX_CLOCK_SKEW` after it, and is newer than the last one taken from its replica, whose sequence number it keeps
until the receiver's clock is past that report's time of sending plus :data:`REPLAY_SECONDS`: as long as a copy of
it could pass the window. A frame taken once is never taken again.
"""

from __future__ import annotations

import hashlib
import hmac
import operator
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import numpy.typing as npt

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
#: the most replicas whose last sequence number is kept (replicas come and go: a new id on every start)
MAX_SEQUENCES = 4 * MAX_PEERS
#: a report's size at most, whatever it holds (a replica reports at most pool.SENT_KEYS keys, 2 MiB of them)
MAX_FRAME_BYTES = 4 << 20
#: a report sent longer ago than this by the receiver's clock (seconds) is not taken (``expired``): a replay, or a
#: sender whose clock is that far behind
REPLAY_SECONDS = 10.0
#: a report sent further ahead of the receiver's clock than this (seconds) is not taken (``future``): the clocks of
#: two replicas must agree within it (a cluster's, kept by NTP, agree within milliseconds)
MAX_CLOCK_SKEW = 5.0
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


class Records(Sequence[tuple[str, list[int]]]):
    """A decoded report's records, each a pod and its keys: checked with the frame, each record's keys read from it
    (Python integers made) only when asked for, :meth:`between` two records for many at once."""

    def __init__(
        self,
        names: Sequence[str],
        where: npt.NDArray[np.uint16],
        counts: npt.NDArray[np.uint16],
        keys: npt.NDArray[np.int64],
    ) -> None:
        self._names, self._where, self._counts, self._keys = names, where, counts, keys
        #: where each record's keys end in ``keys``
        self._ends = np.cumsum(counts, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._where)

    @overload
    def __getitem__(self, index: int) -> tuple[str, list[int]]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, list[int]]]: ...

    def __getitem__(self, index: int | slice) -> tuple[str, list[int]] | list[tuple[str, list[int]]]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return list(self.between(start, stop)) if step == 1 else [self[i] for i in range(start, stop, step)]
        at = operator.index(index)
        at = at + len(self) if at < 0 else at
        if not 0 <= at < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        return next(self.between(at, at + 1))

    def __iter__(self) -> Iterator[tuple[str, list[int]]]:
        for start in range(0, len(self), 1024):
            yield from self.between(start, min(len(self), start + 1024))

    def key_count(self) -> int:
        """How many keys the records hold in all."""
        return int(self._ends[-1]) if len(self) else 0

    def between(self, start: int, stop: int) -> Iterator[tuple[str, list[int]]]:
        """Records ``start`` to ``stop`` (not included), their keys read from the frame at once, each record's list
        made as it is reached (and freed, once used, before the next is: few objects live at once, for the garbage
        collector to count)."""
        stop = max(start, stop)
        first = int(self._ends[start - 1]) if start else 0
        keys = self._keys[first : int(self._ends[stop - 1]) if stop > start else first].tolist()
        names, at = self._names, 0
        for pod, count in zip(self._where[start:stop].tolist(), self._counts[start:stop].tolist(), strict=True):
            yield names[pod], keys[at : at + count]
            at += count

    def stop_after(self, start: int, keys: int) -> int:
        """Where records from ``start`` holding at most ``keys`` keys in all end (one record at least: a slice of a
        report's ingest)."""
        first = int(self._ends[start - 1]) if start else 0
        stop = int(np.searchsorted(self._ends, first + keys, side="right"))
        return min(len(self), max(start + 1, stop))


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
    """The report a frame holds, its signature checked first; :class:`PeerFrameError` for anything else. Its
    records are :class:`Records`: checked, their keys read as used."""
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
        total = int(counts.sum(dtype=np.int64))
        keys = np.frombuffer(body, dtype="<i8", count=total, offset=at)
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
    sent = Records(names, where, counts, keys)
    loads_by_pod = dict(zip(names, loads.tolist(), strict=True))
    return Report(bytes(replica), int(sequence), loads_by_pod, sent, int(sent_at_ms))


@dataclass
class PeerView:
    """The other replicas' newest reports, while fresh: this replica's view of what they route.

    Two clocks: ``now`` (monotonic) says how long ago a report was taken (it stands ``fresh`` seconds); ``wall``
    (this replica's clock, seconds since the epoch) is compared with a report's time of sending (the sender's clock).
    """

    me: bytes
    #: seconds a report stands for its replica (then it is dropped: a replica that stopped, or cannot reach us)
    fresh: float
    #: how long before ``wall`` a report may have been sent (:data:`REPLAY_SECONDS`)
    window: float = REPLAY_SECONDS
    #: how far after ``wall`` a report may have been sent (:data:`MAX_CLOCK_SKEW`)
    skew: float = MAX_CLOCK_SKEW
    _reports: dict[bytes, tuple[float, Report]] = field(default_factory=dict)
    #: per replica, the last sequence number taken and the latest time of sending taken (seconds, the sender's
    #: clock): kept until ``wall`` is ``window`` past that time, at most :data:`MAX_SEQUENCES` replicas
    _sequences: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    #: the latest time of sending of the sequences forgotten: a replica not in ``_sequences`` is taken only from a
    #: report sent after it (it may be one forgotten, early for room or after ``wall`` went back)
    _floor: float = float("-inf")

    def admit(self, report: Report, now: float, wall: float) -> str:
        """Take ``report`` (``accepted``) if it is another replica's, was sent within ``window`` before ``wall`` and
        ``skew`` after it, and is newer than the last report taken from its replica; else why not: ``stale`` (this
        replica's own, no newer than the last taken, or no room for another replica), ``expired`` (sent too long
        ago), ``future`` (sent too far ahead: a clock off by more than ``skew``).

        The invariant: **a frame accepted once is never accepted again** (as long as its sender's clock does not go
        back as its sequence numbers go up), whatever the offset between the two clocks and whenever it is sent
        again. Its replica's sequence number is kept while ``wall`` is at most ``window`` past its time of sending
        (after that a copy is ``expired``), and when it is forgotten (that, or for room) ``_floor`` refuses every
        report of a replica not remembered that was not sent after it (a receiver's clock put back, say). The
        ``skew`` bounds how long that is: ``window + skew`` after it was taken, at most."""
        if report.replica == self.me:
            return "stale"
        sent = report.sent_at_ms / 1000
        if sent > wall + self.skew:
            return "future"
        if sent < wall - self.window:
            return "expired"
        self._expire(now)
        self._forget(wall)
        last = self._sequences.get(report.replica)
        if (sent <= self._floor) if last is None else (report.sequence <= last[0]):
            return "stale"
        if report.replica not in self._reports and len(self._reports) >= MAX_PEERS:
            return "stale"
        self._reports[report.replica] = (now, report)
        self._sequences[report.replica] = (report.sequence, sent if last is None else max(sent, last[1]))
        if len(self._sequences) > MAX_SEQUENCES:  # replicas come and go: the one sent longest ago first
            oldest = min(self._sequences, key=lambda r: self._sequences[r][1])
            self._floor = max(self._floor, self._sequences.pop(oldest)[1])
        return "accepted"

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

    def _forget(self, wall: float) -> None:
        for replica in [r for r, (_, sent) in self._sequences.items() if wall - sent > self.window]:
            self._floor = max(self._floor, self._sequences.pop(replica)[1])
