"""Router replicas reporting to each other over HTTP (peers.py says what a report holds and why).

Every ``interval`` seconds a replica POSTs its report to ``PEER_PATH`` of every address ``--peers`` gives: a list of
``http://host:port``, or ``dns:NAME:PORT``, a name whose addresses are the replicas (a headless Service's, as the
operator renders it), resolved again every ``RESOLVE_SECONDS``. Its own address may be among them: a report from
itself is ignored by its id. Each peer has its own send: one that cannot be reached, answers late or refuses a report
costs its own reports only (counted, ``kvbridge_router_peer_reports_total``; while one send to it is in flight the
next reports to it are skipped), never the others' or the rhythm. A replica that heard nothing fresh from a peer
counts its own requests once more in that peer's place, as a router without peers does. Reports are signed (the
key of the ``<name>-router-peers`` Secret): an unsigned, forged or malformed one is answered 400 with its code and
changes nothing. Nothing routed waits on a report, and no failure of the loop stops it.

A report is checked whole (its signature, its bounds) and its loads are taken as it arrives. Its records (up to
pool.SENT_KEYS keys, 2 MiB) are written into the prefix index at once when they are few (:data:`CHUNK_KEYS` keys at
most) and no other report's wait, else a slice of about :data:`SLICE_SECONDS` at a time, the event loop free between
two, by a task of their own, in the order the reports were taken (an older report's records never land after a newer
one's). At most :data:`MAX_PENDING_BYTES` of reports wait; the records of one more are dropped (its loads count; counted
``records_dropped``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import secrets
import socket
import time
import urllib.parse
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvbridge_router.metrics import RouterMetrics
from kvbridge_router.peers import (
    ID_BYTES,
    MAX_FRAME_BYTES,
    PeerFrameError,
    PeerView,
    Records,
    Report,
    decode,
    encode,
)
from kvbridge_router.pool import Balancer
from kvbridge_router.upstream import Upstream, UpstreamError

log = logging.getLogger(__name__)

PEER_PATH = "/internal/peer-report"
#: how often a ``dns:`` name is resolved again (replicas come and go with rollouts and rescheduling)
RESOLVE_SECONDS = 1.0
#: a resolution that takes longer is given up (the last addresses stay)
RESOLVE_TIMEOUT = 2.0
#: how long one slice of a report's records holds the event loop, about (seconds; one chunk more at most)
SLICE_SECONDS = 0.002
#: keys read from a frame and recorded at a time, within a slice (about 0.5 ms)
CHUNK_KEYS = 2048
#: reports whose records wait to be recorded, in bytes at most (four of the largest)
MAX_PENDING_BYTES = 4 * MAX_FRAME_BYTES


#: a name to resolve: DNS labels, dots between
_DNS_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*\.?")


class PeersError(ValueError):
    """``--peers`` is not a list of ``http://host:port`` or one ``dns:NAME:PORT``."""


def parse_peers(value: str) -> tuple[list[str], tuple[str, int] | None]:
    """``--peers`` as fixed base URLs, or a name and port to resolve; :class:`PeersError` for anything else."""
    value = value.strip()
    if value.startswith("dns:"):
        name, _, port = value[4:].rpartition(":")
        if not _DNS_NAME.fullmatch(name) or not port.isdigit() or not 0 < int(port) < 65536:
            raise PeersError(f"--peers {value!r}: give dns:NAME:PORT (a headless Service's name and the port)")
        return [], (name, int(port))
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    if not urls:
        raise PeersError(f"--peers {value!r}: give http://host:port,... or dns:NAME:PORT")
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url)
            valid = bool(parts.scheme == "http" and parts.hostname and parts.port and not parts.path)
        except ValueError:  # a port out of range, a malformed address
            valid = False
        if not valid or "@" in url:
            raise PeersError(f"--peers: {url!r} is not http://host:port (or give one dns:NAME:PORT)")
    return urls, None


@dataclass
class _Pending:
    """A report's records waiting to be recorded: from ``at`` on; the frame's ``size`` in bytes."""

    records: Records
    at: int
    size: int


class Exchange:
    """One replica's side of the reports: the loop that sends its own, :meth:`receive` for the others'."""

    def __init__(
        self,
        balancer: Balancer,
        metrics: RouterMetrics,
        key: bytes,
        peers: str,
        interval: float,
        pool_pods: Callable[[], Collection[str]],
    ) -> None:
        self.balancer, self.metrics, self.key, self.interval = balancer, metrics, key, interval
        self.fixed, self.name = parse_peers(peers)
        self.me = secrets.token_bytes(ID_BYTES)  # new on every start: a restarted replica is another peer
        self.view = PeerView(self.me, fresh=max(1.0, 5 * interval))
        self.pool_pods = pool_pods
        self.sequence = 0
        self.upstream = Upstream(keepalive=max(4.0, 4 * interval))
        self._resolved: list[str] = []
        self._resolved_at = -RESOLVE_SECONDS
        self._sending: dict[str, asyncio.Task[None]] = {}
        self._resolving: asyncio.Task[None] | None = None
        #: reports' records to record, in the order the reports were taken, and their frames' bytes
        self._pending: collections.deque[_Pending] = collections.deque()
        self._pending_bytes = 0
        self._recording: asyncio.Task[None] | None = None
        balancer.sent = []

    async def run(self, stop: asyncio.Event) -> None:
        """Report every ``interval`` until ``stop`` is set."""
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval):
                        await stop.wait()
                if stop.is_set():
                    return
                try:
                    await self.report()
                except Exception:  # a bug must not end the reports (nor leave stale loads): said, counted, next
                    log.exception("a report to the other router replicas failed")
                    self.metrics.peer_report("sent", "failed")
        finally:
            tasks = [*self._sending.values(), *(t for t in (self._resolving, self._recording) if t is not None)]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.upstream.close()

    async def report(self) -> None:
        """Drop stale reports, then send this replica's report to every peer address, each send a task of its own
        (bounded; one still in flight to a peer skips the next report to that peer)."""
        self._apply()
        targets = self._addresses()
        sent, dropped = self.balancer.drain_sent()
        if dropped:
            self.metrics.peer_report("sent", "records_dropped")
        self.sequence += 1
        report = Report(self.me, self.sequence, dict(self.balancer.outstanding), sent, int(time.time() * 1000))
        frame = encode(report, self.key)
        for url in targets:
            running = self._sending.get(url)
            if running is not None and not running.done():
                self.metrics.peer_report("sent", "skipped")
                continue
            self._sending[url] = asyncio.create_task(self._send(url, frame))
        for url in [u for u, task in self._sending.items() if task.done() and u not in targets]:
            del self._sending[url]  # an address no longer resolved

    def receive(self, frame: bytes) -> str:
        """A peer's report: ``accepted``, ``stale`` (no newer than what it said, or this replica's own), ``expired``
        (sent too long ago: a replay), ``future`` (sent too far ahead: a clock off), or the code of what is wrong with
        it (``PeerFrameError``). Its loads count at once; its records are recorded in slices (:meth:`_take`)."""
        try:
            report = decode(frame, self.key)
        except PeerFrameError as exc:
            self.metrics.peer_report("received", exc.code)
            return exc.code
        outcome = self.view.admit(report, time.monotonic(), time.time())
        if outcome != "accepted":
            self.metrics.peer_report("received", outcome)
            return outcome
        if not isinstance(report.sent, Records):  # decode's, always
            raise TypeError("a decoded report's records")
        self._take(report.sent, len(frame))
        self._apply()
        self.metrics.peer_report("received", "accepted")
        return "accepted"

    async def recorded(self) -> None:
        """Until every report taken so far is recorded."""
        while self._recording is not None and not self._recording.done():
            await asyncio.wait([self._recording])

    def _take(self, records: Records, size: int) -> None:
        """Record a report's records: at once if none wait and they are few (:data:`CHUNK_KEYS` keys at most), else
        a slice now if none wait and the rest (or all) by a task, after those waiting."""
        at = 0
        if not self._pending:
            try:
                asyncio.get_running_loop()
                small = records.key_count() <= CHUNK_KEYS
            except RuntimeError:  # no loop to give back (a caller outside one): all at once
                small = True
            at = self._record(records, 0, float("inf") if small else time.perf_counter() + SLICE_SECONDS)
            if at == len(records):
                return
        if self._pending_bytes + size > MAX_PENDING_BYTES:  # more than can be recorded: this one's records go
            self.metrics.peer_report("received", "records_dropped")
            return
        self._pending.append(_Pending(records, at, size))
        self._pending_bytes += size
        if self._recording is None or self._recording.done():
            self._recording = asyncio.create_task(self._record_pending())

    async def _record_pending(self) -> None:
        while self._pending:
            await asyncio.sleep(0)  # the loop's turn: requests, reports, answers
            pending = self._pending[0]
            try:
                pending.at = self._record(pending.records, pending.at, time.perf_counter() + SLICE_SECONDS)
            except Exception:  # a bug: said, counted, that report's records dropped; the next ones recorded
                log.exception("recording a report of another router replica failed")
                self.metrics.peer_report("received", "failed")
                pending.at = len(pending.records)
            if pending.at == len(pending.records):
                self._pending.popleft()
                self._pending_bytes -= pending.size

    def _record(self, records: Records, at: int, until: float) -> int:
        """Record ``records`` from ``at`` on until ``until`` (``time.perf_counter``), their keys read a chunk at a
        time; where it stopped. A pod that left the pool (or was never in it) is not remembered."""
        pods, record, clock = self.pool_pods(), self.balancer.prefixes.record, time.perf_counter
        while at < len(records):
            for pod, keys in records.between(at, records.stop_after(at, CHUNK_KEYS)):
                if pod in pods:
                    record(pod, keys)
                at += 1
                if clock() >= until:
                    return at
        return at

    def _apply(self) -> None:
        loads, heard = self.view.loads(time.monotonic())
        self.balancer.set_peers(loads, heard)
        self.metrics.peers.set(heard)

    async def _send(self, url: str, frame: bytes) -> None:
        bound = max(1.0, 2 * self.interval)
        try:
            async with asyncio.timeout(bound):
                async with self.upstream.post(
                    url, PEER_PATH, frame, {}, bound, content_type="application/octet-stream"
                ) as answer:
                    await answer.read(1 << 16)
            outcome = "delivered" if answer.status == 200 else f"HTTP_{answer.status}"
        except TimeoutError:
            outcome = "timeout"
        except (UpstreamError, ValueError):  # unreachable, or an address it cannot connect to
            outcome = "unreachable"
        except Exception:  # a bug: said, counted; the next report to this peer is sent as usual
            log.exception("a report to %s failed", url)
            outcome = "failed"
        self.metrics.peer_report("sent", outcome)

    def _addresses(self) -> list[str]:
        """The peers' addresses: the fixed ones, or the name's as last resolved (resolved again in a task of its own
        every ``RESOLVE_SECONDS``: a slow DNS server delays no report)."""
        if self.name is None:
            return self.fixed
        now = time.monotonic()
        if now - self._resolved_at >= RESOLVE_SECONDS and (self._resolving is None or self._resolving.done()):
            self._resolved_at = now
            self._resolving = asyncio.create_task(self._resolve(*self.name))
        return self._resolved

    async def _resolve(self, host: str, port: int) -> None:
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT):
                found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:  # keeps the last addresses: DNS may blink during a rollout
            log.warning("cannot resolve the router peers' name %s: %s", host, exc or "timed out")
            self.metrics.peer_report("sent", "unresolved")
            return
        hosts = sorted({str(info[4][0]) for info in found})
        self._resolved = [f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}" for h in hosts]
