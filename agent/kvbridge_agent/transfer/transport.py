"""A thin owner of one NIXL agent: registration, prepped descriptor lists, READs, notifications.

Every NIXL handle this object creates is tracked and released by
:meth:`Transport.close`, which is idempotent.  The Python progress thread is
off by default (it busy-polls a core per agent); the owner drives progress by
polling transfer states and notifications from its own loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvbridge_agent.core import KVBridgeError

log = logging.getLogger(__name__)

# Stable error codes of the transport.
NIXL_UNAVAILABLE = "NIXL_UNAVAILABLE"
REGISTRATION_FAILED = "REGISTRATION_FAILED"
PEER_METADATA_INVALID = "PEER_METADATA_INVALID"
DESCRIPTOR_PREP_FAILED = "DESCRIPTOR_PREP_FAILED"
TRANSFER_POST_FAILED = "TRANSFER_POST_FAILED"


class TransportError(KVBridgeError):
    code = "TRANSPORT_ERROR"


def _nixl() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - the agent extra installs nixl
        raise TransportError(f"NIXL is not importable: {exc}", code=NIXL_UNAVAILABLE) from exc
    return nixl_agent, nixl_agent_config


class Transport:
    """One NIXL agent of one TP rank."""

    def __init__(
        self,
        name: str,
        backends: Sequence[str] = ("UCX",),
        *,
        progress_thread: bool | None = None,
        ucx_error_handling: str | None = None,
    ) -> None:
        nixl_agent, nixl_agent_config = _nixl()
        nixl_log = logging.getLogger("nixl")  # NIXL logs every agent start at INFO, on stdout
        if nixl_log.getEffectiveLevel() < logging.WARNING:
            nixl_log.setLevel(logging.WARNING)
        if progress_thread is None:
            progress_thread = os.environ.get("KVBRIDGE_NIXL_PROGRESS_THREAD", "0") == "1"
        mode = ucx_error_handling or os.environ.get("KVBRIDGE_UCX_ERROR_HANDLING", "peer")
        self.name = name
        self.backends = list(backends)
        try:
            # telemetry: what each READ posted after NIXL merged adjacent descriptors (:meth:`posted`)
            config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[], capture_telemetry=True)
            self._agent = nixl_agent(name, config)
            for backend in self.backends:
                init = {"ucx_error_handling_mode": mode} if backend == "UCX" else {}
                self._agent.create_backend(backend, init)
        except Exception as exc:
            raise TransportError(f"cannot start NIXL agent {name!r}: {exc}", code=NIXL_UNAVAILABLE) from exc
        self._registrations: list[Any] = []
        self._dlists: list[Any] = []
        self._peers: set[str] = set()
        self._closed = False

    # -- memory -----------------------------------------------------------
    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register each distinct tensor once."""
        try:
            self._registrations.append(self._agent.register_memory(list(tensors)))
        except Exception as exc:
            raise TransportError(f"memory registration failed: {exc}", code=REGISTRATION_FAILED) from exc

    def metadata(self) -> bytes:
        data: bytes = self._agent.get_agent_metadata()
        return data

    # -- peers ------------------------------------------------------------
    def add_peer(self, metadata: bytes, expected: str = "") -> str:
        """Load a remote agent's metadata; returns its name (NIXL gives bytes, notifications use str). With
        ``expected`` (the agent name the peer's rank metadata gives), metadata of another agent is refused.

        NIXL 0.x keeps a remote agent's connection info when a later part of its metadata does not load, and then
        refuses that agent name for good (``remove_remote_agent`` does not clear it); UCX aborts the process on some
        corrupted addresses. So bytes reach this only after the side channel's checksum (core.handshake)."""
        try:
            raw = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransportError(f"remote agent metadata rejected: {exc}", code=PEER_METADATA_INVALID) from exc
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        if expected and name != expected:
            if name not in self._peers:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
            raise TransportError(
                f"the peer's NIXL agent metadata is agent {name[:80]!r}, its rank metadata says {expected[:80]!r}",
                code=PEER_METADATA_INVALID,
            )
        self._peers.add(name)
        try:
            self._agent.make_connection(name)  # warm the first transfer
        except Exception as exc:  # a lazy connection still works; warming is an optimisation
            log.debug("make_connection(%s) failed: %s", name, exc)
        return name

    def remove_peer(self, name: str) -> None:
        if name in self._peers:
            self._peers.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                log.warning("removing remote agent %s failed: %s", name, exc)

    # -- descriptor lists -------------------------------------------------
    def prep(self, peer: str, rows: npt.NDArray[np.int64], memory_type: str) -> Any:
        """Prepare a descriptor list: ``peer`` "" for local memory; ``rows`` Nx5 (strided) or Nx3."""
        try:
            handle = self._agent.prep_xfer_dlist(peer, rows.astype(np.uint64, copy=False), memory_type)
        except Exception as exc:
            raise TransportError(
                f"preparing {len(rows)} descriptor rows for {peer or 'local memory'} failed: {exc}",
                code=DESCRIPTOR_PREP_FAILED,
            ) from exc
        self._dlists.append(handle)
        return handle

    def release_dlist(self, handle: Any) -> None:
        if handle in self._dlists:
            self._dlists.remove(handle)
            try:
                handle.release()
            except Exception as exc:
                log.warning("releasing a descriptor list failed: %s", exc)

    # -- transfers ----------------------------------------------------------
    def make_read(
        self,
        local: Any,
        local_ids: npt.NDArray[np.int32],
        remote: Any,
        remote_ids: npt.NDArray[np.int32],
        notification: bytes,
    ) -> Any:
        """Create one READ between two prepped lists (not posted yet)."""
        try:
            return self._agent.make_prepped_xfer("READ", local, local_ids, remote, remote_ids, notification)
        except Exception as exc:
            raise TransportError(
                f"creating a READ of {local_ids.size} descriptors failed: {exc}", code=TRANSFER_POST_FAILED
            ) from exc

    def post(self, handle: Any) -> None:
        """Post a created READ (the caller still owns the handle, also on failure).

        On a host-memory path the copy may complete inside this call.
        """
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:  # e.g. the remote agent disconnected
            raise TransportError(f"posting a READ failed: {exc}", code=TRANSFER_POST_FAILED) from exc
        if state == "ERR":
            raise TransportError("posting a READ failed", code=TRANSFER_POST_FAILED)

    def read(
        self,
        local: Any,
        local_ids: npt.NDArray[np.int32],
        remote: Any,
        remote_ids: npt.NDArray[np.int32],
        notification: bytes,
    ) -> Any:
        """Create and post one READ; returns the transfer handle."""
        handle = self.make_read(local, local_ids, remote, remote_ids, notification)
        try:
            self.post(handle)
        except TransportError:
            self.release(handle)
            raise
        return handle

    def state(self, handle: Any) -> str:
        """``DONE``, ``PROC`` or ``ERR`` (polling drives progress)."""
        try:
            result: str = self._agent.check_xfer_state(handle)
        except Exception as exc:
            log.warning("checking a transfer failed: %s", exc)
            return "ERR"
        return result

    def posted(self, handle: Any) -> int | None:
        """Descriptors a completed READ posted: NIXL merges the ids of a run adjacent on both sides into one
        (``None`` where it reports no telemetry)."""
        try:
            count = int(self._agent.get_xfer_telemetry(handle).descCount)
        except Exception as exc:  # a NIXL without telemetry: the caller counts the ids it handed
            log.debug("no telemetry of a transfer: %s", exc)
            return None
        return count

    def release(self, handle: Any) -> bool:
        """Release a transfer handle (cancelling it if active); False if NIXL refused."""
        try:
            handle.release()
        except Exception as exc:
            log.warning("releasing a transfer failed: %s", exc)
            return False
        return True

    def notify(self, peer: str, message: bytes) -> None:
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            raise TransportError(f"sending a notification to {peer} failed: {exc}", code=TRANSFER_POST_FAILED) from exc

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender; polling them also drives this agent's progress."""
        try:
            notes: dict[str, list[bytes]] = self._agent.get_new_notifs()
        except Exception as exc:  # a broken peer must not stop the poll loop
            log.warning("polling notifications failed: %s", exc)
            return {}
        return notes

    # -- lifetime -----------------------------------------------------------
    @property
    def open_handles(self) -> int:
        return len(self._registrations) + len(self._dlists) + len(self._peers)

    def close(self) -> None:
        """Release descriptor lists, remote agents and registrations; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for handle in list(self._dlists):
            self.release_dlist(handle)
        for peer in list(self._peers):
            self.remove_peer(peer)
        for registration in self._registrations:
            try:
                self._agent.deregister_memory(registration)
            except Exception as exc:
                log.warning("deregistering memory failed: %s", exc)
        self._registrations.clear()
