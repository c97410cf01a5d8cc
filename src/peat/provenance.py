"""Where a result came from: config hash, vendor and device, package versions, platform.

Every result JSON carries ``stamp(...)`` under the key ``provenance`` so a number in the report
can be traced to the configuration and software that produced it. Nothing here changes from
one run to the next on the same machine (no timestamps, no host names), so stamped outputs
stay bit-identical across reruns.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch

PACKAGES = ("peat", "torch", "numpy", "h5py", "pandas")


def _version(package: str) -> str:
    if package == "torch":
        return str(torch.__version__)  # with the build's local tag (e.g. +cu130): which CUDA/ROCm it targets
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:  # e.g. peat run from a source tree
        return "unknown"


def device_name(vendor: str | None) -> str:
    """The accelerator a vendor's jobs ran on ("cpu" for the CPU vendor)."""
    if vendor in (None, "cpu") or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name()


def stamp(config_hash: str | None = None, vendor: str | None = None) -> dict:
    """Flat provenance record of a result (strings only, so it fits a report table row)."""
    return {"config_hash": config_hash or "", "vendor": vendor or "", "device": device_name(vendor),
            "python": platform.python_version(), **{p: _version(p) for p in PACKAGES},
            "platform": f"{sys.platform}-{platform.machine()}"}


def columns(result: dict) -> dict:
    """A result's provenance as report columns (``prov_<key>``); empty when it has none."""
    return {f"prov_{k}": v for k, v in (result.get("provenance") or {}).items()}
