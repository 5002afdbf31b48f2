"""What a Cloud TPU pod costs, as `status` estimates it: chips × hours × a list price per chip-hour.

The prices are data (PRICES, below), Google's public list prices in US dollars per chip-hour for the
regions the docs use (us-east5, us-central2, us-west4, us-east1), from SOURCE as of AS_OF. They are an
estimate, not the bill: prices differ by region, change, and leave out the VMs' disks, storage and network.
`reserved` is the 1-year committed-use price (a reservation comes with a commitment). Spot prices change
monthly and are not in the table: a spot pod's cost reads `n/a` unless `launch_tpu.sh status --price USD`
(per chip-hour) gives one.
"""
from __future__ import annotations

from diloco.errors import ConfigError
from diloco.tpu import accelerators

SOURCE = "https://cloud.google.com/tpu/pricing"
AS_OF = "2025-06"
CLASSES = ("on-demand", "spot", "reserved")
# generation → capacity class → USD per chip-hour (None: not in the table)
PRICES: dict[str, dict[str, float | None]] = {
    "v4": {"on-demand": 3.22, "spot": None, "reserved": 2.03},
    "v5p": {"on-demand": 4.20, "spot": None, "reserved": 2.94},
    "v5litepod": {"on-demand": 1.20, "spot": None, "reserved": 0.84},
    "v6e": {"on-demand": 2.70, "spot": None, "reserved": 1.89},
}


def capacity_class(capacity: str) -> str:
    """The price class of a bundle's capacity flag: "" → on-demand, spot, reserved; best-effort bills as spot."""
    cls = {"": "on-demand", "best-effort": "spot"}.get(capacity or "", capacity)
    if cls not in CLASSES:
        raise ConfigError("capacity", f"{capacity!r} is not a capacity class; use one of {', '.join(CLASSES)}")
    return cls


def per_hour(plan: dict, price: float | None = None) -> tuple[float | None, str]:
    """(USD per hour of the whole pod, how it was priced): slices × chips per slice × the class's price per
    chip-hour, or × `price` when given; (None, why) when the table has no price for it."""
    try:
        sl, cls = accelerators.parse(plan.get("accelerator", "")), capacity_class(plan.get("capacity", ""))
    except ConfigError as e:
        return None, str(e)
    chips = int(plan.get("slices", 1)) * sl.chips
    each = price if price is not None else PRICES.get(sl.generation, {}).get(cls)
    if each is None:
        return None, f"no {cls} price for {sl.generation} in diloco/tpu/prices.py: pass --price USD_PER_CHIP_HOUR"
    src = "--price" if price is not None else f"{cls} list price of {AS_OF}"
    return chips * each, f"{chips} chips × ${each:.2f}/chip-h ({src}; an estimate)"
