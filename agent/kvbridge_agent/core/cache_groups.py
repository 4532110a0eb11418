"""Several KV cache groups (a hybrid model: full-attention and sliding-window layers) as one list of blocks.

vLLM gives a hybrid model one cache group per kind of layer, overlaid in one allocation: group ``g``'s layer ``i``
and every other group's layer ``i`` share their bytes, and a block id belongs to one group at a time. So every group
has the same physical layout, and a block of group ``g`` holds group ``g``'s layers: moving a request is moving, for
each group, the blocks it needs — all of them for full attention, the last ``ceil(window / block) + 1`` for a
sliding window (the others hold no KV: vLLM frees them, their ids become its null block ``0``).

kvbridge flattens a request's groups into one list, group after group (:meth:`CacheGroups.flatten`), with the size
of each group's part: the READs pair each group's part with the other side's (the last blocks of each, a prefix hit
leaving out first ones), and the digest reads the flat list as one sequence of whole blocks, so a mismatch names the
block at fault in any group.

Pure: no torch, no vLLM. Refusals are :class:`~.errors.BlockMappingError` or :class:`~.errors.SpecError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .arithmetic import ceil_div
from .errors import BlockMappingError, SpecError

#: vLLM's null block: what a group lists where it holds no KV
NULL_BLOCK = 0
# Stable codes.
CACHE_GROUPS_MISMATCH = "CACHE_GROUPS_MISMATCH"
NULL_BLOCK_IN_WINDOW = "NULL_BLOCK_IN_WINDOW"


@dataclass(frozen=True, slots=True)
class CacheGroups:
    """A model's cache groups as kvbridge moves them: per group, the trailing blocks a request needs (``None``: all
    of them), for ``block_size``-token blocks."""

    kept: tuple[int | None, ...]
    block_size: int

    @classmethod
    def of(cls, windows: Sequence[int | None], block_size: int) -> CacheGroups:
        """From each group's sliding window in tokens (``None``: full attention)."""
        if not windows or block_size < 1 or any(w is not None and w < 1 for w in windows):
            raise SpecError(
                f"cache groups with windows {list(windows)} and {block_size}-token blocks",
                field="kv_cache_config.kv_cache_groups",
                code=CACHE_GROUPS_MISMATCH,
            )
        return cls(tuple(None if w is None else ceil_div(w, block_size) + 1 for w in windows), block_size)

    @property
    def count(self) -> int:
        return len(self.kept)

    def clip(self, groups: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        """Each group's blocks a request of ``num_tokens`` tokens needs: its first ``ceil(tokens / block)`` (the
        prompt's), then the last ones a sliding window keeps. A null block among them is an error (it would be read
        or written as if it held KV)."""
        if len(groups) != self.count:
            raise BlockMappingError(
                f"{len(groups)} groups of block ids for a model of {self.count} cache groups",
                field="request.block_ids",
                code=CACHE_GROUPS_MISMATCH,
            )
        blocks = ceil_div(num_tokens, self.block_size)
        clipped: list[list[int]] = []
        for index, (ids, kept) in enumerate(zip(groups, self.kept, strict=True)):
            prompt = [int(b) for b in ids[:blocks]]
            needed = prompt if kept is None else prompt[-kept:]
            if NULL_BLOCK in needed:
                raise BlockMappingError(
                    f"cache group {index} lists the null block among the {len(needed)} blocks it keeps for "
                    f"{num_tokens} tokens",
                    field="request.block_ids",
                    code=NULL_BLOCK_IN_WINDOW,
                )
            clipped.append(needed)
        return clipped

    def flatten(self, groups: Sequence[Sequence[int]], num_tokens: int) -> tuple[list[int], list[int]]:
        """``(the clipped groups one after the other, each group's size)``."""
        clipped = self.clip(groups, num_tokens)
        return [b for group in clipped for b in group], [len(group) for group in clipped]

    def digest_tokens(self, flat: Sequence[int]) -> int:
        """The tokens a digest of a flat list counts: every position of every block (the READs move whole blocks)."""
        return len(flat) * self.block_size


def split(flat: Sequence[int], sizes: Sequence[int], field: str) -> list[list[int]]:
    """A flat list back into its groups; sizes that do not add up are an error."""
    if any(s < 0 for s in sizes) or sum(sizes) != len(flat):
        raise BlockMappingError(
            f"group sizes {list(sizes)} do not add up to the {len(flat)} blocks listed",
            field=field,
            code=CACHE_GROUPS_MISMATCH,
        )
    parts: list[list[int]] = []
    start = 0
    for size in sizes:
        parts.append([int(b) for b in flat[start : start + size]])
        start += size
    return parts


def pair_groups(
    local: Sequence[int], local_sizes: Sequence[int], remote: Sequence[int], remote_sizes: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Per group, ``(decode's blocks to fill, prefill's blocks that fill them)``: the last blocks of prefill's part
    (decode's part may be shorter: a prefix hit leaves out its first blocks)."""
    if len(local_sizes) != len(remote_sizes):
        raise BlockMappingError(
            f"decode has {len(local_sizes)} cache groups, prefill {len(remote_sizes)}: not the same model",
            field="request.remote_group_sizes",
            code=CACHE_GROUPS_MISMATCH,
        )
    pairs: list[tuple[list[int], list[int]]] = []
    for mine, theirs in zip(
        split(local, local_sizes, "request.local_block_ids"),
        split(remote, remote_sizes, "request.remote_block_ids"),
        strict=True,
    ):
        if len(mine) > len(theirs):
            raise BlockMappingError(
                f"decode fills {len(mine)} blocks of a cache group where prefill offers {len(theirs)}",
                field="request.local_block_ids",
                code="LOCAL_LONGER_THAN_REMOTE",
            )
        pairs.append((mine, theirs[len(theirs) - len(mine) :]))
    return pairs
