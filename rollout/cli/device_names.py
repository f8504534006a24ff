"""The device names rollout's commands take (`--device`), checked without torch: a name torch does not know (`tpu`)
was answered with torch's own error, which lists some twenty device types rollout does not run on."""

from __future__ import annotations

import re

__all__ = ["DEVICE_FORMS", "check_device_name"]

DEVICE_FORMS = "cpu, cuda or cuda:N (N: a CUDA device index, as nvidia-smi lists them)"
_DEVICE = re.compile(r"cpu(:0)?|cuda(:[0-9]+)?")  # (torch takes "cpu:0" for the one CPU device too)


def check_device_name(spec: str, flag: str) -> None:
    """Refuse a device name that is none of the forms rollout runs on.

    Args:
        spec: the device as the user gave it ("cuda:1").
        flag: how the user gave it, for the message (e.g. "--device tpu").
    Raises:
        ValueError: naming the flag and listing the accepted forms.
    """
    if _DEVICE.fullmatch(spec) is None:
        raise ValueError(f"{flag}: not a device rollout runs on; give {DEVICE_FORMS}")
