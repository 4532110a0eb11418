"""What the router sent each pod, by prompt prefix: the index the ``kv-aware`` policy scores by.

A prompt is cut into leading chunks, each key hashing the previous key with the chunk, so a key stands for the
whole prefix up to its chunk (as vLLM's prefix-cache block hashes do). Token-id prompts are cut every
``block_tokens`` tokens, the prefill pods' KV block size (vLLM caches whole blocks only, so a chunk is what one
cache hit is); text prompts and chat messages, without a tokenizer, every ``BYTES_PER_TOKEN * block_tokens`` bytes
of their UTF-8 text (roles and contents joined with separators that text cannot contain): a shared system prompt
or an earlier turn gives equal leading keys either way, which is all the score needs. Only whole chunks count.

Per pod, a bounded LRU set of the keys it was sent, and a bound over all pods (:data:`MAX_KEYS`), so that a pool
of hundreds of pods costs the router no more memory than a few. Keys are equal in every process (router replicas
must agree on them, ring.py). The router learns from what it sends, and from what each prefill answer says the
pod's prefix cache served (:meth:`PrefixIndex.lost`: a pod that evicted is forgotten that far, pool.py's
``Balancer.observed``); a pod that restarted or was replaced is forgotten on its new incarnation, one that left the
pool at once. Stale knowledge costs a cache miss on that pod — never a pairing, which the pool alone decides.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import OrderedDict
from collections.abc import Collection, Iterable

import msgspec

from kvbridge_operator.api.objects import Obj
from kvbridge_operator.api.router_settings import DEFAULTS
from kvbridge_router.prompts import TokenIds, one_prompt, token_ids

#: the chunk of token-id prompts when the block size is not given (vLLM's default block size on GPUs)
CHUNK_TOKENS = DEFAULTS.block_size
#: text is chunked by bytes, about this many per token (BPE tokenizers on English: 3.5-4.5)
BYTES_PER_TOKEN = 4
#: at most this many leading chunks are keyed (longer prompts: their first 4096 blocks)
MAX_CHUNKS = 4096
#: keys remembered per pod (about a million prompt tokens' worth of 16-token chunks)
KEYS_PER_POD = 1 << 16
#: keys one prefill answer may make the index forget (:meth:`PrefixIndex.lost`; about 2 ms of the event loop)
MAX_FORGOTTEN = 4096
#: keys remembered in all, over every pod (about 124 bytes each in CPython: 130 MiB at most); with more than
#: ``MAX_KEYS / KEYS_PER_POD`` (16) pods each pod keeps ``MAX_KEYS // pods`` (4096 at 256 pods)
MAX_KEYS = 1 << 20


def prefix_keys(body: Obj, block_tokens: int = CHUNK_TOKENS, *, ids_checked: bool = False) -> list[int]:
    """The chained keys of a completion or chat request's prompt, a key per whole block of ``block_tokens``
    tokens (or ``BYTES_PER_TOKEN`` times as many bytes of text); empty when it has no whole chunk.
    ``ids_checked``: a list prompt has passed :func:`~kvbridge_router.prompts.token_ids` already (the router's
    admission checks a completion's), so it is not checked again."""
    ids = prompt_ids(body, ids_checked)
    # chunks are read as integers (_chained): Python hashes bytes differently in every process, ints and tuples of
    # them alike in all, and router replicas must agree on a prompt's keys (ring.py)
    if ids is not None:
        return _id_keys(ids, block_tokens, _seed(body))
    text = _text(one_prompt(body.get("prompt")), body.get("messages"))
    if not text:
        return []
    data = text.encode("utf-8", "surrogatepass")
    size = BYTES_PER_TOKEN * block_tokens
    keys: list[int] = []
    key = _seed(body)
    for start in range(0, min(len(data) // size, MAX_CHUNKS) * size, size):
        key = _chained(key, data[start : start + size], TEXT)
        keys.append(key)
    return keys


#: a prime modulus beside the one Python hashes integers by (2^61 - 1), :func:`_chained`: 2^30 - 35, below 2^30, so
#: that CPython divides by it in one pass over the integer's digits
_MODULUS = (1 << 30) - 35


#: what a chunk is, in its key: a text prompt whose bytes are a list's digits is not that list of token ids
TEXT, IDS = 0, 1


def _chained(key: int, chunk: bytes, kind: int) -> int:
    """The key of ``chunk`` (of a prompt of ``kind``) after the prefix keyed ``key``: equal in every process. Python
    hashes an integer by its value modulo 2^61 - 1, to which bytes 61 apart weigh the same (2^488 = 1): the chunk read
    as an integer is hashed with its value modulo another prime too, so that only chunks equal modulo both (about
    2^91) share a key."""
    value = int.from_bytes(chunk, "little")
    return hash((key, kind, value, value % _MODULUS))


def _id_keys(ids: TokenIds, block_tokens: int, key: int) -> list[int]:
    """The chained keys of a prompt of token ids, a block of ids at a time as written (``TokenIds.text``)."""
    whole = min(len(ids) // block_tokens, MAX_CHUNKS)
    # where each whole block's last id ends: at its comma
    ends = ids.commas[block_tokens - 1 : block_tokens * whole : block_tokens].tolist()
    if len(ends) < whole:  # the prompt ends with the last whole block: no comma after it
        ends.append(len(ids.text))
    text, start, keys = ids.text, 0, []
    for end in ends:
        key = _chained(key, text[start:end], IDS)
        keys.append(key)
        start = end + 1
    return keys


def prompt_ids(body: Obj, ids_checked: bool = False) -> TokenIds | None:
    """The request's prompt when it is token ids (admission's :class:`TokenIds`, or a list of them: ``ids_checked``
    as for :func:`prefix_keys`), keyed by them; None when it is keyed as text."""
    prompt = one_prompt(body.get("prompt"))
    if isinstance(prompt, TokenIds):
        return prompt
    return TokenIds.of(prompt) if isinstance(prompt, list) and prompt and (ids_checked or token_ids(prompt)) else None


#: request fields with which vLLM's prefix cache holds a prompt apart from the same text without them, from its first
#: block on (a LoRA adapter, named as the model, and a salt are in vLLM's block hashes; special tokens and truncation
#: change the prompt's start): each prompt's first key is seeded with them (:func:`_seed`), so that they are different
#: prefixes to the router too. (Two names of one model, ``--served-model-name a b``, are then keyed apart: a prefix
#: scored as a miss on the pod that holds it under the other name, never an eviction misread.)
SEEDED = ("model", "cache_salt", "add_special_tokens", "truncate_prompt_tokens")
#: seeds by their fields' values, for values that are kept cheaply and compare as they encode: a name or a salt of
#: at most :data:`SEED_KEPT_CHARS` characters, a bool, an int (most requests name one of a few models); a float
#: (``-0.0 == 0.0``, NaN equal to nothing) or a longer text is hashed each time
_SEEDS: dict[tuple[tuple[object, ...], tuple[type, ...]], int] = {}
_MAX_SEEDS = 1024
SEED_KEPT_CHARS = 256
_KEPT_TYPES = frozenset((str, int, bool, type(None)))
#: request fields that change what vLLM caches somewhere in the prompt, where the chat template puts them (tools, a
#: template's inputs): keyed as the same text, so a shared prefix is still scored alike, but what the pod held of such
#: a request is not compared with what the router believed
TEMPLATED = ("tools", "chat_template", "chat_template_kwargs", "documents", "mm_processor_kwargs")
#: the fields of a chat message the router's keys read (others, such as tool calls, change vLLM's tokens unseen)
KEYED_MESSAGE = frozenset(("role", "content"))
_ENCODE = msgspec.json.Encoder().encode


def _seed(body: Obj) -> int:
    """0, or a stable hash (equal in every process) of the request's :data:`SEEDED` fields."""
    values = tuple(body.get(name) for name in SEEDED)
    types = tuple(map(type, values))  # true is not 1 (JSON writes them apart)
    if not _KEPT_TYPES.issuperset(types) or sum(len(v) for v in values if isinstance(v, str)) > SEED_KEPT_CHARS:
        return _hashed(values)  # a float, a list, an object or a long text: not kept
    seed = _SEEDS.get((values, types))
    if seed is None:
        seed = _SEEDS[values, types] = _hashed(values)
        if len(_SEEDS) > _MAX_SEEDS:  # values without end (a salt per tenant, say): forget the oldest
            del _SEEDS[next(iter(_SEEDS))]
    return seed


def _hashed(values: tuple[object, ...]) -> int:
    seeded = [(name, value) for name, value in zip(SEEDED, values, strict=True) if value is not None]
    if not seeded:
        return 0
    try:
        encoded = _ENCODE(seeded)
    except (TypeError, ValueError, OverflowError):  # a lone surrogate in a salt: the standard library writes it
        encoded = json.dumps(seeded).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(encoded, digest_size=8).digest(), "little")


def cached_as_keyed(body: Obj) -> bool:
    """Whether what a prefill pod says its cache served of this request can be compared with what the router
    believed: not with prompt logprobs or echo (vLLM then reads nothing from its cache for the request), a field of
    :data:`TEMPLATED`, or chat messages with more than a role and text (media, tool calls: tokens the keys miss)."""
    if body.get("prompt_logprobs") is not None or body.get("echo") or any(body.get(f) for f in TEMPLATED):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True
    for message in messages:
        if not isinstance(message, dict) or not KEYED_MESSAGE.issuperset(message):
            return False
        parts = message.get("content")
        if isinstance(parts, list) and any(not isinstance(p, dict) or p.get("type", "text") != "text" for p in parts):
            return False
    return True


def held_chunks(cached_tokens: int, block_tokens: int, prompt_tokens: int | None) -> int:
    """How many leading chunks of a prompt a prefill pod held at most, by the prompt tokens its prefix cache served
    (vLLM's ``remote_prefill_cached_tokens``, whole blocks): for a prompt of ``prompt_tokens`` token ids, one chunk a
    block, and all of them when it served every block before the last token (vLLM always computes that one, so a
    prompt of whole blocks hits one block less than it holds); for text
    (``None``: chunked by bytes, without a tokenizer), twice as many and one more, which holds up to 8 bytes a token,
    so that only a pod that lacked part of what it was sent reads as one that evicted it."""
    blocks = cached_tokens // block_tokens
    if prompt_tokens is None:
        return 2 * blocks + 1
    return MAX_CHUNKS if blocks >= (prompt_tokens - 1) // block_tokens else blocks


def _text(prompt: object, messages: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):  # OpenAI content parts: their text, in order
                    content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                parts.append(f"{message.get('role', '')}\x1f{content if isinstance(content, str) else ''}")
        return "\x1e".join(parts)
    return ""


class PrefixIndex:
    """Per pod, the prefix keys it was sent (an LRU set each); ``max_keys`` in all, shared evenly by the pods."""

    def __init__(self, keys_per_pod: int = KEYS_PER_POD, max_keys: int = MAX_KEYS) -> None:
        self.keys_per_pod = keys_per_pod
        self.max_keys = max_keys
        #: per pod, its keys, oldest first, each with the tick of the record that last put it there (increasing)
        self._pods: dict[str, OrderedDict[int, int]] = {}
        self._tick = 0
        #: the pods that hold each prompt's first key, while they do (one pod as itself, more as a set): a request
        #: asks which pods can match at all with one lookup, not one per pod
        self._holders: dict[int, str | set[str]] = {}
        #: records given a tick but not written yet (:meth:`record` ``later``), in tick order
        self._later: list[tuple[str, list[int], int]] = []

    def flush(self) -> None:
        """Write the records made ``later`` (:meth:`record`). Every other method does this first, so that no use of
        the index misses one."""
        later, self._later = self._later, []
        for pod, keys, tick in later:
            self._write(pod, keys, tick)

    def limit(self) -> int:
        """The most keys one pod keeps now: ``keys_per_pod``, or the pods' even share of ``max_keys``."""
        return max(1, min(self.keys_per_pod, self.max_keys // max(1, len(self._pods))))

    def size(self) -> int:
        """The keys remembered, over every pod (at most ``max_keys``, or one per pod when there are more pods)."""
        if self._later:
            self.flush()
        return sum(len(known) for known in self._pods.values())

    def footprint(self) -> int:
        """Bytes the index holds, at most (its tables and its keys; a key shared by pods is counted per pod)."""
        if self._later:
            self.flush()
        holders = sys.getsizeof(self._holders) + sum(
            sys.getsizeof(pods) for pods in self._holders.values() if isinstance(pods, set)
        )
        return holders + sum(sys.getsizeof(known) + sum(map(sys.getsizeof, known)) for known in self._pods.values())

    def holders(self, first: int) -> Collection[str]:
        """The pods that hold a prompt's first key: the only ones whose :meth:`matched` can be above 0, so that a
        request scores only these among hundreds. (A key that a pod holds only as a later chunk of another prompt
        is not counted: that takes a collision of chained keys, and would cost a cache hit, never a pairing.)"""
        if self._later:
            self.flush()
        pods = self._holders.get(first)
        if pods is None:
            return ()
        return (pods,) if isinstance(pods, str) else tuple(pods)

    def matched(self, pod: str, keys: list[int]) -> int:
        """How many leading keys of a prompt the pod was sent (its cached prefix, in chunks, as far as known)."""
        if self._later:
            self.flush()
        known = self._pods.get(pod)
        if not known:
            return 0
        count = 0
        for key in keys:
            if key not in known:
                break
            count += 1
        return count

    def ticks(self, pod: str, keys: list[int], count: int) -> list[int]:
        """When the pod was last sent each of the prompt's ``count`` leading keys (it holds them: :meth:`matched`), as
        record ticks, for :meth:`lost` once the pod says what it held."""
        if self._later:
            self.flush()
        known = self._pods.get(pod)
        return [known[key] for key in keys[:count]] if known else []

    def lost(self, pod: str, tick: int) -> int:
        """The pod no longer holds a block it was sent at ``tick`` (its prefix cache evicted it): it evicted, least
        recently used first as vLLM does, what it was sent before it too; forget those, at most
        :data:`MAX_FORGOTTEN` (the oldest) in one call, so that one answer never stalls the router long. The number of
        keys forgotten."""
        if self._later:
            self.flush()
        known = self._pods.get(pod)
        forgotten = 0
        while known and forgotten < MAX_FORGOTTEN and next(iter(known.values())) <= tick:
            key, _ = known.popitem(last=False)
            if key in self._holders:
                self._drop_holder(key, pod)
            forgotten += 1
        return forgotten

    def unrecord(self, pod: str, keys: list[int], tick: int) -> None:
        """The record at ``tick`` was never computed (its prefill failed): forget its keys that no later record sent
        the pod again."""
        if self._later:
            self.flush()
        known = self._pods.get(pod)
        if not known:
            return
        for key in keys:
            if known.get(key) == tick:
                del known[key]
                if key in self._holders:
                    self._drop_holder(key, pod)

    def record(self, pod: str, keys: list[int], *, later: bool = False) -> int:
        """The pod is computing (prefill) or holding (decode) this prompt: remember its keys, newest last, the
        prompt's first key newest of all, so that a pod's share runs out at the tails of its prompts first: as vLLM
        frees a request's blocks, tail first, so that its prefix cache keeps a prefix longest. A prompt partly
        forgotten still matches its leading chunks (a first key forgotten first would hide the whole prompt, while
        its tail, which no request can hit without it, took room). The record's tick (0: no keys).

        ``later``: the tick is given now, the keys written at the index's next use or :meth:`flush`, so that a router
        can send the request it chose first (the engine starts on it while the index is written)."""
        if not keys:
            return 0
        if self._later and not later:
            self.flush()
        self._tick += 1
        if later:
            self._later.append((pod, keys, self._tick))
        else:
            self._write(pod, keys, self._tick)
        return self._tick

    def _write(self, pod: str, keys: list[int], tick: int) -> None:
        known = self._pods.get(pod)
        if known is None:
            known = self._pods[pod] = OrderedDict()
            self._trim_all()  # one more pod: every pod's share shrinks
        for key in reversed(keys):
            known[key] = tick
            known.move_to_end(key)
        first = keys[0]
        pods = self._holders.get(first)
        if pods is None:
            self._holders[first] = pod
        elif isinstance(pods, str):
            if pods != pod:
                self._holders[first] = {pods, pod}
        else:
            pods.add(pod)
        self._trim(pod, known, self.limit())

    def keep_only(self, pods: Iterable[str]) -> None:
        """Forget pods that left the pool (scaled down, replaced by a rollout)."""
        if self._later:
            self.flush()
        kept = set(pods)
        for pod in [p for p in self._pods if p not in kept]:
            for key in self._pods.pop(pod):
                self._drop_holder(key, pod)

    def _trim_all(self) -> None:
        limit = self.limit()
        for pod, known in self._pods.items():
            self._trim(pod, known, limit)

    def _trim(self, pod: str, known: OrderedDict[int, int], limit: int) -> None:
        while len(known) > limit:
            key, _ = known.popitem(last=False)
            if key in self._holders:
                self._drop_holder(key, pod)

    def _drop_holder(self, key: int, pod: str) -> None:
        """``pod`` no longer holds ``key``: it is no holder of it as a first key either."""
        pods = self._holders.get(key)
        if pods is None:
            return
        if isinstance(pods, str):
            if pods == pod:
                del self._holders[key]
            return
        pods.discard(pod)
        if len(pods) == 1:
            self._holders[key] = next(iter(pods))
