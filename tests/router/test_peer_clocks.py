"""Router replicas' reports and their clocks (issue 56, finding 5): a report's window runs on its sender's clock, its
replica's sequence number is kept on the receiver's; whatever the offset between the two, and whenever a captured
frame is sent again, a frame accepted once is never accepted again."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_router import peering
from kvbridge_router.metrics import RouterMetrics
from kvbridge_router.peering import Exchange
from kvbridge_router.peers import MAX_CLOCK_SKEW, MAX_SEQUENCES, REPLAY_SECONDS, PeerView, Report, encode
from kvbridge_router.pool import Balancer

KEY = b"k" * 32
A, B = b"a" * 16, b"b" * 16
#: the receiver's clock at the start (seconds since the epoch)
EPOCH = 1_700_000_000.0


@dataclass
class Clocks:
    """The receiver's clocks, as peering.py reads them (``time.time``, ``time.monotonic``), moved by the test."""

    wall: float = EPOCH
    mono: float = 1000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def perf_counter(self) -> float:
        return time.perf_counter()

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@contextmanager
def receiver(clocks: Clocks) -> Iterator[Exchange]:
    """A replica's exchange (default interval: reports fresh 1 s) reading ``clocks``."""
    with mock.patch.object(peering, "time", clocks):
        yield Exchange(Balancer(replicas=2), RouterMetrics(), KEY, "http://127.0.0.1:1", 0.05, frozenset)


def frame(sequence: int, sent_at: float, replica: bytes = B) -> bytes:
    return encode(Report(replica, sequence, {"p": sequence}, (), round(sent_at * 1000)), KEY)


def test_a_frame_captured_from_a_sender_whose_clock_is_ahead_is_not_taken_again_later() -> None:
    """The finding: the sender's clock 5 s ahead, a frame taken at 0 is stale at +0.5 s, and was taken again at
    +11.5 s (its sequence number forgotten at +11 s on the receiver's clock, its window open until +15 s on the
    sender's). Now the sequence number is kept while the window is open."""
    clocks = Clocks()
    with receiver(clocks) as exchange:
        captured = frame(1, clocks.wall + 5.0)
        assert exchange.receive(captured) == "accepted"
        clocks.advance(0.5)
        assert exchange.receive(captured) == "stale"
        for later in (11.0, 11.5, 12.0, 14.9):
            clocks.wall = EPOCH + later
            clocks.mono = 1000.0 + later
            assert exchange.receive(captured) == "stale", later
        clocks.advance(0.2)  # +15.1 s: the window is shut
        assert exchange.receive(captured) == "expired"
        assert exchange.receive(frame(2, clocks.wall + 5.0)) == "accepted"  # while the sender's next are taken


def test_a_frame_from_further_ahead_than_the_skew_bound_is_refused_and_counted() -> None:
    clocks = Clocks()
    with receiver(clocks) as exchange:
        assert exchange.receive(frame(1, clocks.wall + MAX_CLOCK_SKEW + 0.5)) == "future"
        assert exchange.receive(frame(2, clocks.wall + MAX_CLOCK_SKEW - 0.5)) == "accepted"
        assert exchange.receive(frame(3, clocks.wall - REPLAY_SECONDS - 0.5)) == "expired"
        assert exchange.receive(frame(4, clocks.wall - REPLAY_SECONDS + 0.5)) == "accepted"
        outcomes = exchange.metrics.peer_reports
        assert outcomes.labels("received", "future")._value.get() == 1
        assert outcomes.labels("received", "expired")._value.get() == 1
        assert outcomes.labels("received", "accepted")._value.get() == 2


def test_a_replica_forgotten_for_room_cannot_be_replayed() -> None:
    """More replicas than the view remembers: the one sent longest ago is forgotten first, and its frames (sent no
    later than that) are refused as long as the window would take them."""
    view = PeerView(me=A, fresh=0.1)
    first = Report(B, 1, {"p": 1}, sent_at_ms=round(EPOCH * 1000))
    assert view.admit(first, now=0.0, wall=EPOCH) == "accepted"
    for i in range(MAX_SEQUENCES):
        other = Report(i.to_bytes(16, "little"), 1, {}, sent_at_ms=round((EPOCH + 1 + i / 1000) * 1000))
        assert view.admit(other, now=1.0 + i, wall=EPOCH + 1 + i / 1000) == "accepted"
    assert len(view._sequences) == MAX_SEQUENCES
    assert B not in view._sequences
    assert view.admit(first, now=1000.0, wall=EPOCH + 2) == "stale"
    later = Report(B, 2, {"p": 1}, sent_at_ms=round((EPOCH + 3) * 1000))
    assert view.admit(later, now=1001.0, wall=EPOCH + 3) == "accepted"  # its next report is taken


def test_a_frame_is_not_taken_again_after_the_receivers_clock_is_put_back() -> None:
    view = PeerView(me=A, fresh=1.0)
    report = Report(B, 1, {"p": 1}, sent_at_ms=round(EPOCH * 1000))
    assert view.admit(report, now=0.0, wall=EPOCH) == "accepted"
    assert (
        view.admit(Report(b"c" * 16, 1, {}, sent_at_ms=round((EPOCH + 11) * 1000)), now=11.0, wall=EPOCH + 11)
        == "accepted"
    )
    assert B not in view._sequences  # forgotten: out of the window
    assert view.admit(report, now=12.0, wall=EPOCH + 1) == "stale"  # the clock put back 11 s: in the window again


#: what happens between two reports: the clocks move ``dt`` seconds, then the sender sends its next report
#: (``send``), or a frame captured before is sent again (``replay``, the ``which``-th), or the receiver's wall clock
#: is put forward or back by ``dt - 6`` seconds (``step``: NTP, a VM resumed), its monotonic one going on
events = st.lists(
    st.tuples(st.sampled_from(["send", "replay", "replay", "step"]), st.floats(0, 12), st.integers(0, 1000)),
    max_size=40,
)


@given(
    # the sender's clock minus the receiver's: within and beyond the skew bound, and beyond the window
    st.one_of(st.floats(-2 * REPLAY_SECONDS, 3 * MAX_CLOCK_SKEW), st.sampled_from([-10.0, -5.0, 0.0, 5.0, 4.99])),
    events,
)
@settings(max_examples=400, deadline=None)
def test_a_frame_accepted_once_is_never_accepted_again(offset: float, happenings: list[tuple[str, float, int]]) -> None:
    clocks = Clocks()
    accepted: Counter[int] = Counter()
    sent: list[tuple[int, bytes]] = []
    stepped = False
    with receiver(clocks) as exchange:
        for what, dt, which in happenings:
            if what == "step":  # the receiver's wall clock only
                clocks.wall += dt - 6
                stepped = True
                continue
            clocks.advance(dt)
            sender = clocks.mono - 1000.0 + EPOCH + offset  # the sender's clock: never put back
            if what == "send":
                sent.append((len(sent) + 1, frame(len(sent) + 1, sender)))
                sequence, outcome = sent[-1][0], exchange.receive(sent[-1][1])
                drift = sender - clocks.wall
                if not stepped and -REPLAY_SECONDS + 0.01 < drift < MAX_CLOCK_SKEW - 0.01:
                    assert outcome == "accepted", (drift, outcome)  # a fresh frame is taken: not all refused
                if drift > MAX_CLOCK_SKEW + 0.01:
                    assert outcome == "future"
                if drift < -REPLAY_SECONDS - 0.01:
                    assert outcome == "expired"
            elif sent:
                sequence, captured = sent[which % len(sent)]
                outcome = exchange.receive(captured)
            else:
                continue
            if outcome == "accepted":
                accepted[sequence] += 1
    assert all(count == 1 for count in accepted.values()), accepted
