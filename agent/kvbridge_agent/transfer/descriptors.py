"""NIXL descriptor rows for a rank's regions: compact strided rows when the spacing is uniform."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbridge_agent.core import RegionLayout, unit_addresses
from kvbridge_agent.core.geometry import strided_rows


def descriptor_rows(
    bases: Sequence[int],
    layout: RegionLayout,
    num_blocks: int,
    *,
    units_per_block: int,
    offset: int,
    length: int,
    device_id: int,
) -> npt.NDArray[np.int64]:
    """Nx5 strided rows (one per region) when possible, else Nx3 rows (one per descriptor)."""
    rows = strided_rows(
        bases, layout, num_blocks, units_per_block=units_per_block, offset=offset, length=length, device_id=device_id
    )
    if rows is not None:
        return rows
    addresses = unit_addresses(bases, layout, num_blocks, units_per_block=units_per_block, offset=offset, length=length)
    full = np.empty((addresses.size, 3), dtype=np.int64)
    full[:, 0] = addresses
    full[:, 1] = length
    full[:, 2] = device_id
    return full
