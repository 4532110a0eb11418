"""Several KV cache groups (a hybrid model: full-attention and sliding-window layers) as one list of blocks.

vLLM gives a hybrid model one cache group per kind of layer, overlaid in one allocation: group ``g``'s layer ``i``
and every other group's layer ``i`` share their bytes, and a block id belongs to one group at a time. Groups hold
the same number of layers, but for vLLM's padding: a kind of layer whose count the group size does not divide gets a
last group of fewer layers (five layers, two full and three sliding, are groups of 2, 2 and 1 layers; Gemma-3-1B's
26 are 4, 4, 4, 4, 3, 3 and 4). So every group has the physical layout of the deepest one, a block of group ``g``
holds group ``g``'s layers in its first :attr:`CacheGroups.depths` ``[g]`` layer slots, and the slots past them are
padding: moved with the block (nothing else uses them while the block is the group's), never digested.

Moving a request is moving, for each group, the blocks it keeps: all the prompt's for full attention; for a sliding
window exactly those vLLM's ``SlidingWindowManager`` has not freed once the prompt's ``n`` tokens are computed — its
``get_num_skipped_tokens(n) = max(0, n - window + 1 - extra_retained_tokens)`` tokens are skipped, and the first
``skipped // block`` blocks of the group are vLLM's null block ``0`` (:meth:`CacheGroups.skipped_blocks`). Prefill's
table frees at most as many (it computed fewer tokens when it last freed), decode's exactly as many (it allocates
``n`` external tokens at once), so both sides keep the same blocks and decode reads every one it holds.

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
    """A model's cache groups as kvbridge moves them, for ``block_size``-token blocks: each group's sliding window
    in tokens (``None``: full attention), the tokens vLLM retains below it (its ``extra_retained_tokens``) and the
    layers it holds (``None``: as many as the deepest group)."""

    windows: tuple[int | None, ...]
    block_size: int
    retained: tuple[int, ...] = ()
    layers: tuple[int, ...] | None = None

    @classmethod
    def of(
        cls,
        windows: Sequence[int | None],
        block_size: int,
        retained: Sequence[int] | None = None,
        layers: Sequence[int] | None = None,
    ) -> CacheGroups:
        """From each group's sliding window in tokens (``None``: full attention), its retained tokens and layers."""
        extra = tuple(retained) if retained is not None else (0,) * len(windows)
        depths = tuple(layers) if layers is not None else None
        if (
            not windows
            or block_size < 1
            or any(w is not None and w < 1 for w in windows)
            or len(extra) != len(windows)
            or any(r < 0 for r in extra)
            or (depths is not None and (len(depths) != len(windows) or any(d < 1 for d in depths)))
        ):
            raise SpecError(
                f"cache groups with windows {list(windows)}, retained tokens {list(extra)}, layers "
                f"{None if depths is None else list(depths)} and {block_size}-token blocks",
                field="kv_cache_config.kv_cache_groups",
                code=CACHE_GROUPS_MISMATCH,
            )
        return cls(tuple(windows), block_size, extra, depths)

    @property
    def count(self) -> int:
        return len(self.windows)

    @property
    def depths(self) -> tuple[int, ...] | None:
        """Each group's layers where some group holds fewer than the deepest (vLLM padded them); else ``None``."""
        if self.layers is None or len(set(self.layers)) == 1:
            return None
        return self.layers

    def skipped_blocks(self, group: int, num_tokens: int) -> int:
        """The first blocks of ``group`` vLLM has freed (made its null block) once ``num_tokens`` are computed:
        ``SlidingWindowManager.get_num_skipped_tokens(num_tokens) // block_size``; 0 for full attention."""
        window = self.windows[group]
        if window is None:
            return 0
        extra = self.retained[group] if self.retained else 0
        return max(0, num_tokens - window + 1 - extra) // self.block_size

    def sizes(self, num_tokens: int) -> list[int]:
        """How many blocks each group keeps for a request of ``num_tokens`` tokens."""
        blocks = ceil_div(num_tokens, self.block_size)
        return [blocks - min(blocks, self.skipped_blocks(g, num_tokens)) for g in range(self.count)]

    def clip(self, groups: Sequence[Sequence[int]], num_tokens: int) -> list[list[int]]:
        """Each group's blocks a request of ``num_tokens`` tokens needs: of its first ``ceil(tokens / block)`` (the
        prompt's), those a sliding window has not freed (:meth:`skipped_blocks`). A null block among them is an
        error (it would be read or written as if it held KV)."""
        if len(groups) != self.count:
            raise BlockMappingError(
                f"{len(groups)} groups of block ids for a model of {self.count} cache groups",
                field="request.block_ids",
                code=CACHE_GROUPS_MISMATCH,
            )
        blocks = ceil_div(num_tokens, self.block_size)
        clipped: list[list[int]] = []
        for index, ids in enumerate(groups):
            prompt = [int(b) for b in ids[:blocks]]
            needed = prompt[self.skipped_blocks(index, num_tokens) :]
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

    def block_layers(self, sizes: Sequence[int]) -> list[int] | None:
        """Per block of a flat list of ``sizes`` blocks per group, the layer slots that hold its group's KV (the
        digest reads no more); ``None`` when no group is padded (every block holds every slot)."""
        depths = self.depths
        if depths is None:
            return None
        return [depth for depth, size in zip(depths, sizes, strict=True) for _ in range(size)]

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
