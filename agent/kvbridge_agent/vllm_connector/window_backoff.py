"""Sliding windows: prefill computes all of the prompt but its last token, decode computes that token itself.

vLLM 0.32 loses one token of a sliding window in P/D as it stands. Decode allocates a remote prompt of ``n`` tokens
at once, its sliding-window groups' first ``(n - window + 1) // block`` blocks as the null block
(``SlidingWindowManager.get_num_skipped_tokens(n)``, in ``add_local_computed_blocks``), then, the load done,
rewinds to ``n - 1`` computed tokens and recomputes token ``n - 1`` to sample from it
(``Scheduler._update_waiting_for_remote_kv``). That token attends to tokens ``n - window .. n - 1``; when
``n - window + 1`` is a multiple of the block size the block holding token ``n - window`` is one of the nulls — on
prefill too, which frees the same blocks before offering them (``Scheduler._connector_finished``). Decode's
attention then reads the null block's bytes as that token's key and value: the first token's logits and the KV
of token ``n - 1`` are wrong, no check fails. Seen with vLLM's own NixlConnector on vLLM's CPU build (a tiny
Gemma-3, window 32, blocks 32: prompts of 63, 95, 127 and 159 tokens changed the first token's log probabilities
and, for 3 of 12 prompts, the greedy tokens; 31-33, 64, 65, 96 did not; docs/vllm.md).

kvbridge does what vLLM's NixlConnector does for Mamba state (its ``_prefill_backoff``), at those lengths only:
prefill drops the prompt's last token before scheduling it (:meth:`WindowBackoff.truncate`, from
``on_new_request``) where that token's window would reach into a block either role's manager frees
(:func:`at_window_edge`, with each role's block size), and offers ``n - 1`` tokens, every block of their window kept
(vLLM frees ``(n - window) // block`` then); decode loads those ``n - 1`` tokens (:meth:`WindowBackoff.remote_tokens`)
and computes token ``n - 1`` as its first step — the one token it recomputed anyway. The transfer parameters'
``promptHash`` stays the client's whole prompt (a signing router binds decode's request to it). Applied where
vLLM made sliding-window cache groups, or the model has a sliding window (vLLM's ``get_sliding_window()``, or
``spec.model.layerTypes``): on vLLM's CPU build, one group, nothing is freed and the backoff changes nothing, but it
runs all the same, so real vLLM runs it (tests/vllm/test_gemma3.py); decode takes a prefill that offers the whole
prompt too (a release without this).
"""

from __future__ import annotations

from typing import Any

from kvbridge_agent.core import Role
from kvbridge_agent.core.model import LayerType
from kvbridge_agent.core.signing import request_prompt_hash

from .settings import ConnectorSettings


def sliding_windows(settings: ConnectorSettings) -> list[tuple[int, int]]:
    """Each sliding window vLLM frees blocks for, with the tokens it retains below it: its sliding-window cache
    groups'; with one group (no hybrid allocator: nothing freed, the backoff is harmless), the model's window as
    vLLM reads it, or as ``spec.model`` says where it has sliding-window layers."""
    groups = settings.groups
    if groups is not None:
        retained = groups.retained or (0,) * groups.count
        return sorted({(w, r) for w, r in zip(groups.windows, retained, strict=True) if w is not None})
    if settings.sliding_window:
        return [(settings.sliding_window, 0)]
    model = settings.model
    return [(model.sliding_window, 0)] if model.sliding_window and LayerType.SLIDING in model.layer_kinds else []


def at_window_edge(num_tokens: int, windows: list[tuple[int, int]], blocks: tuple[int, ...]) -> bool:
    """Whether the prompt's last token (``num_tokens - 1``) attends to a token in a block a manager of one of
    ``blocks`` tokens has freed once ``num_tokens`` are computed: the window's first token ``num_tokens - window``
    lies below ``SlidingWindowManager.get_num_skipped_tokens(num_tokens)`` rounded down to whole blocks."""
    for window, retained in windows:
        first = num_tokens - window
        skipped = max(0, num_tokens - window + 1 - retained)
        if first >= 0 and any(first // block < skipped // block for block in blocks):
            return True
    return False


class WindowBackoff:
    """Prefill: which requests it cut short, and their whole prompt's hash; decode: how many tokens to load."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.windows = sliding_windows(settings)
        self.prefill = settings.role is Role.PREFILL
        environment = settings.environment
        self.blocks = (environment.prefill.block_size, environment.decode.block_size)
        self._prompt_hashes: dict[str, str | None] = {}

    def truncate(self, request: Any) -> None:
        """Prefill, a new request to be offered to decode whose prompt ends at a window edge: drop its last token
        (as vLLM's ``NixlConnectorScheduler._truncate_request_for_prefill`` does), once; remember the whole prompt's
        hash."""
        raw, prompt = request.kv_transfer_params, getattr(request, "prompt_token_ids", None)
        skip = getattr(request, "get_skip_reading_prefix_cache", None)
        if (
            not self.prefill
            or not isinstance(raw, dict)
            or not raw.get("do_remote_decode")
            or request.request_id in self._prompt_hashes
            or prompt is None
            or not at_window_edge(len(prompt), self.windows, self.blocks)
            or (skip is not None and skip())  # prompt logprobs: decode recomputes the whole prompt anyway
        ):
            return
        self._prompt_hashes[request.request_id] = request_prompt_hash(request)
        del prompt[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1

    def prompt_hash(self, request: Any) -> str | None:
        """The hash of the prompt the client sent (before :meth:`truncate`)."""
        if request.request_id in self._prompt_hashes:
            return self._prompt_hashes[request.request_id]
        return request_prompt_hash(request)

    def forget(self, request_id: str) -> None:
        self._prompt_hashes.pop(request_id, None)

    def remote_tokens(self, prompt: int, offered: int) -> int:
        """Decode: the prompt's tokens to load when prefill offered ``offered`` of its ``prompt``: those offered where
        prefill left the last one to decode, else the whole prompt (:meth:`mismatch` says if it is not)."""
        return offered if self.windows and prompt - offered == 1 else prompt

    def mismatch(self, prompt: int, offered: int) -> str:
        """Decode: why ``offered`` tokens cannot be this prompt's of ``prompt`` tokens ("" when they can)."""
        if self.remote_tokens(prompt, offered) == offered:
            return ""
        return (
            f"PROMPT_MISMATCH: decode's prompt has {prompt} tokens, the prefill computed {offered}: this is not the "
            "request prefill ran"
        )
