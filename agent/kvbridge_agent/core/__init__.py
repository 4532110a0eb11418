"""The pure core: geometry, compatibility rules, TP mapping, plans and block ids.

Reading order:
- ``model``: the words of both sides: a model's KV cache geometry and one engine role's settings.
- ``errors``: typed errors and problems, each with a stable code and the field at fault.
- ``compat``: can these prefill and decode settings exchange KV caches (every violation at once).
- ``fingerprint``: the short hash of everything that must match on both sides.
- ``parallel``: data and expert parallelism: each DP rank a KV peer of its own (engine id, side-channel port).
- ``tp``: which decode rank reads which prefill ranks.
- ``geometry``: a rank's regions and block strides, numbered by cache kind.
- ``layout``: vLLM's physical layouts (``KVCacheLayout``) as byte strides; two sides' contiguous runs.
- ``physical_reads``: what one decode rank reads from each prefill rank when both caches have physical layouts.
- ``cache_groups``: a hybrid model's KV cache groups as one list of blocks.
- ``wire``: the wire format and the conversions each side performs.
- ``plan``: the transfer plan, built once per pair of engines.
- ``blocks``: per-request block ids to descriptor ids (numpy, the hot path).
- ``staging``: staged reads: both sides' segments of a read, and the cost model that picks direct or staged.
- ``arithmetic``: checked integer division.
- ``handshake``: the side channel's messages.
- ``stage_requests``: the side channel's ``stage`` message, and what prefill derives from one.
- ``admission``: what decode admits of transfer parameters: its deployment's bounds, prefill hosts among them.
- ``contract``: the environment variables the operator renders and every engine reads.
- ``digest``: a keyed digest of KV content wherever it is stored (the numpy reference).
- ``signing``: the router's signature on ``kv_transfer_params``.
- ``tracing``: the names of kvbridge's spans and attributes, and the checks on W3C trace context.

Imports nothing but pydantic and numpy, so the operator can use it and the
plan math is testable in microseconds.
"""

from .blocks import MappedBlocks, blocks_for_tokens, descriptor_ids, map_request_blocks, wire_block_ids
from .compat import PROBLEM_CODES, check_pair, check_same_model, require_compatible
from .errors import BlockMappingError, IncompatibleError, KVBridgeError, Problem, SpecError
from .fingerprint import fingerprint
from .geometry import RegionLayout, heads_local, region_layout, unit_addresses
from .model import (
    PROTOCOL_VERSION,
    Attention,
    CacheKind,
    Conversion,
    KVCacheDtype,
    KVLayout,
    ModelGeometry,
    Role,
    RoleSettings,
    TransferSettings,
    Verification,
)
from .plan import DecodeRankPlan, Read, TransferPlan, build_plan, plan_or_problems
from .wire import ConversionKind, ConversionStep, WireFormat, wire_format

__all__ = [
    "PROBLEM_CODES",
    "PROTOCOL_VERSION",
    "Attention",
    "BlockMappingError",
    "CacheKind",
    "Conversion",
    "ConversionKind",
    "ConversionStep",
    "DecodeRankPlan",
    "IncompatibleError",
    "KVBridgeError",
    "KVCacheDtype",
    "KVLayout",
    "MappedBlocks",
    "ModelGeometry",
    "Problem",
    "Read",
    "RegionLayout",
    "Role",
    "RoleSettings",
    "SpecError",
    "TransferPlan",
    "TransferSettings",
    "Verification",
    "WireFormat",
    "blocks_for_tokens",
    "build_plan",
    "check_pair",
    "check_same_model",
    "descriptor_ids",
    "fingerprint",
    "heads_local",
    "map_request_blocks",
    "plan_or_problems",
    "region_layout",
    "require_compatible",
    "unit_addresses",
    "wire_block_ids",
    "wire_format",
]
