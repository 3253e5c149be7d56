"""Where a shard's valid copies are, as one state per shard, and the only legal moves.

A shard has up to three copies: on the device (the working copy a module computes with), on the
host (the master the optimizer updates; for NVMe-backed shards it sits in the staging arena),
and in an NVMe extent. The state names exactly which copies are valid and whether an NVMe
transfer is in flight. "Dirty" is implied by the state: ``HOST`` and ``DEVICE_HOST`` mean the
host copy is newer than NVMe (or the shard has no NVMe home); ``*_NVME`` states are clean.

Device copies are never newer than the host copy: parameters change only in the optimizer step,
which runs on the host master. So dropping a device copy is always free, and dropping a host copy
is free only when an NVMe copy is valid.

Every state change goes through :func:`check_transition`; the table below is the whole story.
"""

from __future__ import annotations

from enum import Enum


class Residency(Enum):
    #: nothing valid (registered and not initialised, or discarded: a consumed gradient)
    EMPTY = "empty"
    #: only the NVMe extent is valid
    NVME = "nvme"
    #: NVMe valid; a read into a host slot is in flight (host slot not yet valid)
    NVME_LOADING = "nvme, loading to host"
    #: host only (no NVMe home, or the NVMe copy is stale): dirty with respect to NVMe
    HOST = "host (dirty)"
    #: host valid; a write of it to NVMe is in flight
    HOST_STORING = "host, storing to nvme"
    #: host and NVMe valid and equal
    HOST_NVME = "host + nvme"
    #: device and host valid; host dirty with respect to NVMe (or no NVMe home)
    DEVICE_HOST = "device + host (dirty)"
    #: device, host and NVMe valid
    DEVICE_HOST_NVME = "device + host + nvme"
    #: device and NVMe valid; the host slot was released (streamed through a buffer)
    DEVICE_NVME = "device + nvme"

    @property
    def on_device(self) -> bool:
        return self in _ON_DEVICE

    @property
    def on_host(self) -> bool:
        """A valid host copy exists (the bytes in the host slot can be read)."""
        return self in _ON_HOST

    @property
    def on_nvme(self) -> bool:
        """A valid NVMe copy exists."""
        return self in _ON_NVME

    @property
    def in_flight(self) -> bool:
        return self in (Residency.NVME_LOADING, Residency.HOST_STORING)

    @property
    def dirty(self) -> bool:
        """The host copy is the only up-to-date copy below the device."""
        return self in (Residency.HOST, Residency.DEVICE_HOST, Residency.HOST_STORING)


_ON_DEVICE = frozenset({Residency.DEVICE_HOST, Residency.DEVICE_HOST_NVME, Residency.DEVICE_NVME})
_ON_HOST = frozenset(
    {
        Residency.HOST,
        Residency.HOST_STORING,
        Residency.HOST_NVME,
        Residency.DEVICE_HOST,
        Residency.DEVICE_HOST_NVME,
    }
)
_ON_NVME = frozenset(
    {
        Residency.NVME,
        Residency.NVME_LOADING,
        Residency.HOST_NVME,
        Residency.DEVICE_HOST_NVME,
        Residency.DEVICE_NVME,
    }
)

R = Residency

#: state -> states it may move to. Comments name the operation.
TRANSITIONS: dict[Residency, frozenset[Residency]] = {
    R.EMPTY: frozenset(
        {
            R.HOST,  # initialise from the model's tensor
        }
    ),
    R.NVME: frozenset(
        {
            R.NVME_LOADING,  # start reading into a host slot
            R.EMPTY,  # discard (a gradient after the step, zero_grad)
            R.DEVICE_NVME,  # gather from its compute copy: the master stays on NVMe
        }
    ),
    R.NVME_LOADING: frozenset(
        {
            R.HOST_NVME,  # read completed
            R.NVME,  # read failed: the NVMe copy is still the valid one
        }
    ),
    R.HOST: frozenset(
        {
            R.HOST_STORING,  # start writing back
            R.DEVICE_HOST,  # gather to device
            R.HOST,  # updated again (optimizer step, load_state_dict)
            R.EMPTY,  # discard
        }
    ),
    R.HOST_STORING: frozenset(
        {
            R.HOST_NVME,  # write completed
            R.HOST,  # write failed: host stays the only valid copy
        }
    ),
    R.HOST_NVME: frozenset(
        {
            R.NVME,  # evict the host slot (NVMe copy is valid)
            R.DEVICE_HOST_NVME,  # gather to device
            R.HOST,  # updated on the host: NVMe copy now stale
            R.EMPTY,  # discard
        }
    ),
    R.DEVICE_HOST: frozenset(
        {
            R.HOST,  # release the device copy
        }
    ),
    R.DEVICE_HOST_NVME: frozenset(
        {
            R.HOST_NVME,  # release the device copy
            R.DEVICE_NVME,  # evict the host slot, keep computing on the device copy
        }
    ),
    R.DEVICE_NVME: frozenset(
        {
            R.NVME,  # release the device copy
        }
    ),
}


#: a device copy made (a valid host copy becomes shared with the device, or, on NVMe only, the
#: master's compute copy was read instead: precision.storage_dtype with an optimizer) and dropped
ON_TO_DEVICE = {R.HOST: R.DEVICE_HOST, R.HOST_NVME: R.DEVICE_HOST_NVME, R.NVME: R.DEVICE_NVME}
OFF_THE_DEVICE = {R.DEVICE_HOST: R.HOST, R.DEVICE_HOST_NVME: R.HOST_NVME, R.DEVICE_NVME: R.NVME}


class ResidencyError(RuntimeError):
    """A state change that the transition table does not allow."""


def check_transition(shard_id: str, old: Residency, new: Residency) -> None:
    if new not in TRANSITIONS[old]:
        allowed = ", ".join(sorted(s.name for s in TRANSITIONS[old])) or "none"
        raise ResidencyError(
            f"shard {shard_id}: illegal residency change {old.name} -> "
            f"{new.name} (allowed from {old.name}: {allowed})"
        )
