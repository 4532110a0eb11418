"""Client authentication: API keys as OpenAI's clients send them, ``Authorization: Bearer <key>``; pure.

The keys come from a file, one a line (``--api-key-file``: the operator mounts ``spec.router.apiKeySecret`` there),
and from ``KVBRIDGE_ROUTER_API_KEYS`` (comma- or newline-separated); blank lines and
surrounding whitespace do not count. A key given is compared with every configured key, all of them each time, by
``hmac.compare_digest`` over SHA-256 digests (equal lengths: neither the position of the first wrong byte nor a
key's length shows in the time taken). The file is read again when it changes (a Secret's new keys reach the
mounted file within a minute or two), looked at no more often than every :data:`RECHECK_SECONDS`; a file that
became unreadable or empty keeps the keys last read, so a rotation gone wrong never opens the router.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from kvbridge_agent.core import SpecError
from kvbridge_operator.api.router_settings import API_KEYS_VARIABLE

log = logging.getLogger(__name__)

#: the router cannot start: the key file cannot be read, or no key is configured where keys were asked for
API_KEYS_UNREADABLE = "API_KEYS_UNREADABLE"
#: a request without a configured key (401)
INVALID_API_KEY = "INVALID_API_KEY"
#: seconds between looks at the key file's modification time
RECHECK_SECONDS = 10.0
_SEPARATORS = re.compile(r"[,\r\n]")


def _keys(text: str) -> list[str]:
    return [key.strip() for key in _SEPARATORS.split(text) if key.strip()]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class ApiKeys:
    """The configured keys, as digests; :meth:`refused` judges a request's ``Authorization`` header."""

    def __init__(self, path: str = "", extra: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        """``path``: the key file (empty: none); ``extra``: more keys, comma- or newline-separated. Raises
        :class:`SpecError` (:data:`API_KEYS_UNREADABLE`) when the file cannot be read or no key is configured."""
        self.path, self._clock = path, clock
        self._extra = [_digest(key) for key in _keys(extra)]
        self._file: list[bytes] = []
        self._stamp: float | None = None
        self._looked = clock()
        if path:
            self._file, self._stamp = self._read()
        if not self._file and not self._extra:
            where = f"the file {path}" if path else API_KEYS_VARIABLE
            raise SpecError(
                f"{where} holds no API key: put one key a line (the Secret of spec.router.apiKeySecret)",
                field=path or API_KEYS_VARIABLE,
                code=API_KEYS_UNREADABLE,
            )

    @classmethod
    def configured(cls, path: str, environ: Mapping[str, str], variable: str) -> ApiKeys | None:
        """The keys of ``path`` and of ``environ[variable]``; ``None`` when neither is given (no authentication)."""
        extra = environ.get(variable, "")
        if not path and not extra.strip():
            return None
        return cls(path, extra)

    def __len__(self) -> int:
        return len(self._file) + len(self._extra)

    def refused(self, authorization: str | None) -> str | None:
        """``None`` when ``authorization`` is ``Bearer <a configured key>``, else why not (the 401's message)."""
        if not authorization:
            return "no API key: send one as 'Authorization: Bearer KEY'"
        scheme, _, given = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return "the Authorization header must be 'Bearer KEY'"
        self._recheck()
        digest = _digest(given.strip())
        matched = False
        for key in (*self._file, *self._extra):  # every key, whichever matches: the time says nothing of which
            matched |= hmac.compare_digest(digest, key)
        return None if matched else "the API key is not one of this router's"

    def _recheck(self) -> None:
        if not self.path or self._clock() - self._looked < RECHECK_SECONDS:
            return
        self._looked = self._clock()
        try:
            stamp = os.stat(self.path).st_mtime
        except OSError as exc:
            log.warning("API key file %s: %s; keeping the %d keys last read", self.path, exc, len(self._file))
            return
        if stamp == self._stamp:
            return
        try:
            keys, stamp = self._read()
        except SpecError as exc:
            log.warning("%s; keeping the %d keys last read", exc.message, len(self._file))
            return
        if not keys:
            log.warning("API key file %s holds no key now; keeping the %d keys last read", self.path, len(self._file))
            return
        self._file, self._stamp = keys, stamp
        log.info("API key file %s read again: %d keys", self.path, len(keys))

    def _read(self) -> tuple[list[bytes], float]:
        try:
            path = Path(self.path)
            stamp = path.stat().st_mtime
            text = path.read_text(encoding="utf-8", errors="surrogateescape")
        except OSError as exc:
            raise SpecError(
                f"cannot read the API key file {self.path}: {exc.strerror or exc}",
                field=self.path,
                code=API_KEYS_UNREADABLE,
            ) from None
        return [_digest(key) for key in _keys(text)], stamp
