"""Whether a survivor's device is fit to rejoin after its groups were torn down.

A failure that ended a peer may have hurt this process's GPU too: a kernel that never ends, a
sticky CUDA error (an illegal address, an ECC error: every later call on the context fails),
or a fault the driver reports through NVML. A survivor that rejoined with such a device would
fail the new generation at once, and the agent would restart everything; replacing it alone
costs one new process. So before it rejoins, a survivor checks its own device
(:func:`device_health`, :func:`elasticft.devicehealth.check_device`):

1. a synchronize of the rank's device, under the teardown's time limit, from a helper thread
   that first made that device its current one (a new thread's is device 0): a kernel still
   running after the abort, or a hung device, does not finish in it;
2. CUDA's sticky errors, which that synchronize raises;
3. NVML's answers for that GPU, named by its PCI bus id (or UUID), where ``pynvml`` is
   installed: retired pages or a row remapping pending, a failed remapping, a recovery action
   the driver asks for, and uncorrectable ECC errors since recovery armed.

The rank's device and NVML's baseline are taken when recovery arms
(:meth:`elasticft.devicehealth.ArmedDevice.arm`, from the group's bound ``device_id`` or the
main thread's current device). A process without a CUDA device (gloo on CPU) passes at once.
The check returns why the device is unfit, or None; the verdict's evidence goes to the log.
:class:`elasticft.inprocess.groups.GroupOps` carries it as the seam tests replace.
"""

from __future__ import annotations

import json
import logging

from elasticft.devicehealth import ArmedDevice, capture_rank_device, within

__all__ = ["ArmedDevice", "device_health", "within"]

logger = logging.getLogger(__name__)


def device_health(limit_s: float, armed: ArmedDevice | None = None) -> str | None:
    """Why the rank's device (``armed``: taken when recovery armed; else the caller's current
    device, with no ECC baseline) is unfit to rejoin, or None (see the module)."""
    if armed is None:
        armed = ArmedDevice(capture_rank_device(None))
    verdict = armed.check(limit_s)
    logger.info("device health before the rejoin: %s", json.dumps(verdict.to_json()))
    return None if verdict.ok else verdict.detail
