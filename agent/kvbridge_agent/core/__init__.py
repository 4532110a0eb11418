"""The pure core: geometry, compatibility rules, TP mapping, plans and block ids.

Imports nothing but pydantic and numpy, so the operator can use it and the
plan math is testable in microseconds.

``geometry`` numbers a rank's regions by cache kind; ``layout`` describes vLLM's physical layouts
(``KVCacheLayout``) as byte strides and pairs two sides' contiguous runs.
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
