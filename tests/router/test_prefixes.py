"""The kv-aware policy (issue 28, in part): prompt prefix keys without a tokenizer, the per-pod index, and the
choice it makes — the pod that was sent the prompt's prefix, unless it is much busier; least-loaded unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge_operator.api.router_settings import RouterPolicy
from kvbridge_router.pool import KV_AWARE, LEAST_LOADED, LOAD_SLACK, ROUND_ROBIN, Balancer, Pool
from kvbridge_router.prefixes import (
    _SEEDS,
    BYTES_PER_TOKEN,
    CHUNK_TOKENS,
    MAX_CHUNKS,
    MAX_FORGOTTEN,
    SEED_KEPT_CHARS,
    PrefixIndex,
    cached_as_keyed,
    held_chunks,
    prefix_keys,
)

#: the text of one default chunk
CHUNK_BYTES = BYTES_PER_TOKEN * CHUNK_TOKENS


def pool(prefills: int = 2, decodes: int = 2) -> Pool:
    def endpoint(name: str, i: int) -> dict[str, str | int]:
        return {"pod": name, "ip": f"10.0.0.{i}", "httpPort": 8000, "pairing": "k"}

    return Pool.from_status(
        {
            "prefill": {"endpoints": [endpoint(f"p{i}", i) for i in range(prefills)]},
            "decode": {"endpoints": [endpoint(f"d{i}", 10 + i) for i in range(decodes)]},
        }
    )


def test_the_policies_are_the_specs() -> None:
    assert {KV_AWARE, LEAST_LOADED, ROUND_ROBIN} == {p.value for p in RouterPolicy}


def test_keys_chain_whole_chunks_of_tokens_text_and_chat() -> None:
    system = list(range(100, 100 + 3 * CHUNK_TOKENS))
    a, b = prefix_keys({"prompt": [*system, 1, 2, 3]}), prefix_keys({"prompt": [*system, 9] * 1})
    assert len(a) == 3
    assert a == b  # the same leading chunks, different tails shorter than a chunk
    assert prefix_keys({"prompt": [7, *system]})[0] != a[0]  # a prefix, not a bag of chunks
    assert prefix_keys({"prompt": list(range(CHUNK_TOKENS - 1))}) == []
    text = "You are a careful assistant. " * 10
    assert prefix_keys({"prompt": text + "Q1"})[:4] == prefix_keys({"prompt": text + "Q2"})[:4]
    assert len(prefix_keys({"prompt": "x" * (2 * CHUNK_BYTES + 5)})) == 2
    chat = [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]
    followup = [*chat, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    first, second = prefix_keys({"messages": chat}), prefix_keys({"messages": followup})
    assert first
    assert second[: len(first) - 1] == first[:-1]  # a chat's next turn shares its leading chunks
    parts = [{"role": "system", "content": [{"type": "text", "text": text}]}]
    assert prefix_keys({"messages": parts})[:3] == prefix_keys({"messages": [{"role": "system", "content": text}]})[:3]
    for body in ({}, {"prompt": 5}, {"prompt": [1.5] * 40}, {"messages": "x"}, {"prompt": [True] * 40}):
        assert prefix_keys(body) == []  # nothing to key: routed by load


def test_keys_are_per_block_of_the_prefill_pods_block_size() -> None:
    """vLLM caches whole blocks: with 32-token blocks a 48-token shared prefix is one block of hits, not three
    16-token chunks."""
    shared = list(range(200, 248))
    a, b = prefix_keys({"prompt": [*shared, 1] * 1}, 32), prefix_keys({"prompt": [*shared, *range(40)]}, 32)
    assert len(a) == 1
    assert b[0] == a[0]
    assert len(b) == (48 + 40) // 32
    assert prefix_keys({"prompt": shared}, 16)[0] != a[0]  # a different block size: different keys
    assert len(prefix_keys({"prompt": "y" * (BYTES_PER_TOKEN * 32 * 3 + 1)}, 32)) == 3  # text: bytes per block
    assert prefix_keys({"prompt": [shared]}, 32) == prefix_keys({"prompt": shared}, 32)  # one prompt in a list


def test_the_index_is_bounded_and_forgets_pods_that_left() -> None:
    index = PrefixIndex(keys_per_pod=8)
    keys = list(range(20))
    index.record("p0", keys)
    assert index.matched("p0", keys) == 8  # the tail was forgotten first: the leading 8 chunks still match
    assert index.holders(keys[0]) == ("p0",)
    other = list(range(100, 106))  # another prompt
    index.record("p0", other)
    assert index.matched("p0", other) == 6
    assert index.matched("p0", keys) == 2  # the older prompt lost its tail again, its head kept
    index.record("p0", keys[:4])
    assert index.matched("p0", keys) == 4
    index.keep_only(["p1"])
    assert index.matched("p0", keys) == 0


def test_kv_aware_follows_the_prefix_unless_the_pod_is_much_busier() -> None:
    balancer, routes = Balancer(policy=KV_AWARE), pool()
    shared = prefix_keys({"prompt": list(range(8 * CHUNK_TOKENS))})
    first = balancer.choose(routes, keys=shared)
    assert first is not None
    for _ in range(5):  # the same prefix keeps going to the same pair
        again = balancer.choose(routes, keys=shared)
        assert again == first
        assert balancer.last_matched == len(shared)
    other = prefix_keys({"prompt": list(range(500, 500 + 8 * CHUNK_TOKENS))})
    assert balancer.choose(routes, keys=other) is not None
    assert balancer.last_matched == 0
    for _ in range(LOAD_SLACK + 1):  # the prefix holder is now busier than the other by more than the slack
        balancer.started(first[0].pod)
    moved = balancer.choose(routes, keys=shared)
    assert moved is not None
    assert moved[0] != first[0]


def test_least_loaded_ignores_prefixes() -> None:
    balancer, routes = Balancer(policy=LEAST_LOADED), pool()
    shared = prefix_keys({"prompt": list(range(8 * CHUNK_TOKENS))})
    chosen = []
    for _ in range(4):
        pair = balancer.choose(routes, keys=shared)
        assert pair is not None
        chosen.append(pair[0].pod)
    assert set(chosen) == {"p0", "p1"}  # round-robin among equally loaded pods


def test_a_pod_that_evicted_a_block_is_taken_to_have_evicted_what_it_was_sent_before() -> None:
    index = PrefixIndex()
    first, second, third = list(range(10)), list(range(100, 110)), list(range(200, 210))
    for keys in (first, second, third):
        index.record("p0", keys)
    index.record("p1", first)
    ticks = index.ticks("p0", second, index.matched("p0", second))
    assert len(ticks) == 10
    assert len(set(ticks)) == 1  # one record: one tick
    assert index.ticks("p0", second, 3) == ticks[:3]
    assert index.lost("p0", ticks[2]) == 20  # the first and second prompts, sent up to then
    assert (index.matched("p0", first), index.matched("p0", second), index.matched("p0", third)) == (0, 0, 10)
    assert index.holders(first[0]) == ("p1",)  # another pod's view is its own
    assert index.matched("p1", first) == 10
    assert index.lost("p0", ticks[2]) == 0
    assert index.lost("nobody", ticks[2]) == 0
    assert index.ticks("nobody", first, 3) == []


@pytest.mark.parametrize(
    ("cached", "prompt_tokens", "held"),
    [
        (0, 64, 0),
        (16, 64, 1),
        (47, 64, 2),  # whole blocks only
        (48, 64, MAX_CHUNKS),  # every block before the last token, which vLLM always computes: all of it
        (63, 64, MAX_CHUNKS),
        (48, 100, 3),
        (0, None, 1),  # text: twice the blocks and one more (up to 8 bytes a token)
        (48, None, 7),
    ],
)
def test_what_a_pod_held_is_read_from_the_tokens_its_cache_served(
    cached: int, prompt_tokens: int | None, held: int
) -> None:
    assert held_chunks(cached, 16, prompt_tokens) == held


def test_a_shortfall_is_read_as_an_eviction_only_when_nothing_else_explains_it() -> None:
    routes = pool(prefills=1)
    balancer = Balancer(policy=KV_AWARE)
    older = prefix_keys({"prompt": list(range(1000, 1000 + 4 * CHUNK_TOKENS))})
    keys = prefix_keys({"prompt": list(range(4 * CHUNK_TOKENS))})

    def send(prompt: list[int], computed: bool = True) -> tuple[str, list[int], int]:
        pair = balancer.choose(routes, keys=prompt)
        assert pair is not None
        believed, tick = balancer.last_ticks, balancer.last_tick
        balancer.prefilled(pair[0].pod, tick, prompt, balancer.last_matched, computed)
        return pair[0].pod, believed, tick

    send(older)
    pod, _, _ = send(keys)
    _, believed, _ = send(keys)
    assert len(believed) == 4
    assert balancer.observed(pod, believed, 3) == 0  # one chunk short: a coarser hit (speculative decoding), not news
    assert balancer.choose(routes, keys=keys) is not None  # a copy of the prompt still being prefilled...
    copy = balancer.last_tick
    assert balancer.choose(routes, keys=keys) is not None  # ...and another, which may overtake it
    overtaking, believed = balancer.last_tick, balancer.last_ticks
    assert believed == []  # its chunks' record is the copy's, in flight: nothing to compare, whoever answers first
    balancer.prefilled(pod, overtaking, keys, 4, computed=False)  # the overtaking one failed; the copy still runs
    assert balancer.choose(routes, keys=keys) is not None
    assert balancer.last_ticks == []  # still nothing to compare: the copy's chunks are not cached yet
    for tick in (copy, balancer.last_tick):
        balancer.prefilled(pod, tick, keys, 4, computed=True)
    assert balancer.observed(pod, believed, 0) == 0
    assert balancer.prefixes.matched(pod, older) == 4
    _, believed, _ = send(keys)
    assert balancer.observed(pod, believed, 0) > 0  # a real shortfall: what was sent before is forgotten
    assert balancer.prefixes.matched(pod, older) == 0


def test_a_prompt_whose_prefill_failed_is_not_believed_held() -> None:
    routes = pool(prefills=1)
    balancer = Balancer(policy=KV_AWARE)
    held, failed = list(range(2 * CHUNK_TOKENS)), list(range(2 * CHUNK_TOKENS, 5 * CHUNK_TOKENS))
    keys = prefix_keys({"prompt": held + failed})
    first = balancer.choose(routes, keys=keys[:2])
    assert first is not None
    balancer.prefilled(first[0].pod, balancer.last_tick, keys[:2], 0, computed=True)
    assert balancer.choose(routes, keys=keys) is not None
    assert balancer.last_matched == 2
    balancer.prefilled(first[0].pod, balancer.last_tick, keys, 2, computed=False)  # failed: the rest never cached
    assert balancer.prefixes.matched(first[0].pod, keys) == 2  # what the earlier prefill left is still held
    assert not balancer._prefilling  # nothing left in flight


def test_lost_forgets_at_most_a_bound_per_answer() -> None:
    index = PrefixIndex()
    for start in range(0, MAX_FORGOTTEN + 100, 10):
        index.record("p0", list(range(start, start + 10)))
    last = index.ticks("p0", [MAX_FORGOTTEN + 90], 1)[0]
    assert index.lost("p0", last) == MAX_FORGOTTEN  # the oldest first
    assert index.lost("p0", last) == 94  # the rest up to that record, at the next answer
    assert index.size() == 10


CHAT = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "hi"}]
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}


@pytest.mark.parametrize(
    ("body", "compared"),
    [
        ({"prompt": [1, 2]}, True),
        ({"prompt": [1, 2], "echo": False, "prompt_logprobs": None, "tools": []}, True),
        ({"prompt": [1, 2], "cache_salt": "tenant-a"}, True),  # keyed apart: its own prefix, compared as such
        ({"prompt": [1, 2], "prompt_logprobs": 0}, False),  # vLLM reads nothing from its cache then
        ({"prompt": [1, 2], "echo": True}, False),
        ({"messages": CHAT}, True),
        ({"messages": CHAT, "tools": [{"type": "function"}]}, False),  # where the template puts them: unseen
        ({"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}]}, False),
        ({"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, False),
        ({"messages": [*CHAT, {"role": "user", "content": "x", "name": "bob"}]}, False),
        ({"messages": ["not a message"]}, False),
    ],
)
def test_what_a_pod_held_is_compared_only_where_the_keys_see_what_vllm_cached(
    body: dict[str, Any], compared: bool
) -> None:
    assert cached_as_keyed(body) is compared


def test_a_salted_prompt_is_its_own_prefix_and_the_templates_inputs_are_not() -> None:
    """A salt seeds vLLM's first block hash, and special tokens or truncation change a prompt's start: the router's
    keys of it differ from the first chunk on, equal for equal ones. Tools, a template's inputs and media land where
    the template puts them: the keys stay the text's, so a shared system prompt is still scored alike."""
    plain = prefix_keys({"messages": CHAT})
    salted = [prefix_keys({"messages": CHAT, "cache_salt": salt}) for salt in ("tenant-a", "tenant-b", "tenant-a")]
    assert salted[0] == salted[2]
    assert len({plain[0], salted[0][0], salted[1][0]}) == 3
    assert prefix_keys({"messages": CHAT, "add_special_tokens": False})[0] != plain[0]
    assert prefix_keys({"messages": CHAT, "cache_salt": None}) == plain
    assert prefix_keys({"messages": CHAT, "cache_salt": "\ud800"})  # not plain JSON: still keyed
    parts = [{"role": "system", "content": [{"type": "text", "text": CHAT[0]["content"]}, IMAGE]}, CHAT[1]]
    for body in ({"messages": CHAT, "tools": [{"type": "function"}]}, {"messages": parts}):
        assert prefix_keys(body) == plain


def test_a_prompt_for_another_model_or_lora_adapter_is_its_own_prefix() -> None:
    """vLLM's block hashes include a LoRA adapter, which a request names as its model: the router keys a prompt per
    model named, so a prompt sent for an adapter is never believed held, nor read as evicted, by its base model's
    record of it. Equal seeds of equal values, whatever was seen before (true is not 1)."""
    prompt = list(range(3 * CHUNK_TOKENS))
    base, adapter = prefix_keys({"prompt": prompt, "model": "base"}), prefix_keys({"prompt": prompt, "model": "sql"})
    assert base[0] != adapter[0]
    assert prefix_keys({"prompt": prompt, "model": "base"}) == base
    assert prefix_keys({"prompt": prompt})[0] not in (base[0], adapter[0])
    ones = [prefix_keys({"prompt": prompt, "add_special_tokens": value})[0] for value in (True, 1, 1.0, True)]
    assert len(set(ones[:3])) == 3
    assert ones[3] == ones[0]
    assert prefix_keys({"prompt": prompt, "model": ["not", "a", "name"]})  # refused by vLLM; keyed all the same
    zeros = [prefix_keys({"prompt": prompt, "truncate_prompt_tokens": value})[0] for value in (-0.0, 0.0, -0.0)]
    assert zeros[0] != zeros[1]  # equal floats written apart: hashed each time, never one cached for both
    assert zeros[0] == zeros[2]
    long_salt = "s" * (SEED_KEPT_CHARS + 1)
    assert prefix_keys({"prompt": prompt, "cache_salt": long_salt}) == prefix_keys(
        {"prompt": prompt, "cache_salt": long_salt}
    )
    assert not any(long_salt in values for values, _ in _SEEDS)  # a long salt is not kept
    index = PrefixIndex()
    index.record("p0", base)
    assert index.matched("p0", adapter) == 0


def test_other_replicas_hear_of_a_prefill_pod_once_its_prefill_ended() -> None:
    """A report carries a prefill pod's prompt once its prefill was computed (never a failed one), so that a replica
    can trust what it hears as it trusts its own; a decode pod's as chosen."""
    routes = pool(prefills=1, decodes=1)
    balancer = Balancer(policy=KV_AWARE)
    balancer.sent = []
    keys = prefix_keys({"prompt": list(range(3 * CHUNK_TOKENS))})
    for computed in (False, True):
        pair = balancer.choose(routes, keys=keys)
        assert pair is not None
        assert balancer.drain_sent()[0] == [(pair[1].pod, keys)]  # the decode pod at once
        balancer.prefilled(pair[0].pod, balancer.last_tick, keys, balancer.last_matched, computed)
        assert balancer.drain_sent()[0] == ([(pair[0].pod, keys)] if computed else [])


def test_a_report_says_once_what_a_pod_was_sent_again_since_the_last() -> None:
    """A prompt's samples (n > 1), or a hot prompt, go to the same pods several times within a report's interval: the
    report says so once per pod; after a report, again."""
    routes = pool(prefills=1, decodes=1)
    balancer = Balancer(policy=KV_AWARE)
    balancer.sent = []
    keys, other = (prefix_keys({"prompt": list(range(start, start + 2 * CHUNK_TOKENS))}) for start in (0, 100))
    for prompt in (keys, keys, other, list(keys)):  # an equal prompt in a list of its own too
        pair = balancer.choose(routes, keys=prompt)
        assert pair is not None
        balancer.prefilled(pair[0].pod, balancer.last_tick, prompt, balancer.last_matched, computed=True)
    sent, dropped = balancer.drain_sent()
    assert sorted(sent) == sorted([("d0", keys), ("p0", keys), ("d0", other), ("p0", other)])
    assert dropped == 0
    assert balancer.choose(routes, keys=keys) is not None
    assert balancer.drain_sent()[0] == [("d0", keys)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(0, 2)), max_size=30))
def test_a_choice_says_how_much_of_the_prompt_its_prefill_pod_had_been_sent(
    requests: list[tuple[list[int], int]],
) -> None:
    """``last_matched`` is the chosen prefill pod's match before the choice, whether the pod was chosen by its score,
    by the ring or by load; and the choice's records are in the index at its next use."""
    routes = pool(prefills=3)
    balancer = Balancer(policy=KV_AWARE)
    for chunks, busy in requests:
        keys = prefix_keys({"prompt": [token for chunk in chunks for token in [chunk] * CHUNK_TOKENS]})
        for _ in range(busy):
            balancer.started("p1")
        before = {target.pod: balancer.prefixes.matched(target.pod, keys) for target in routes.prefill}
        pair = balancer.choose(routes, keys=keys)
        assert pair is not None
        assert balancer.last_matched == before[pair[0].pod]
        assert balancer.prefixes.matched(pair[0].pod, keys) == len(keys)  # recorded, written at this use
        assert balancer.prefixes.matched(pair[1].pod, keys) == len(keys)
        balancer.prefilled(pair[0].pod, balancer.last_tick, keys, balancer.last_matched, computed=True)
