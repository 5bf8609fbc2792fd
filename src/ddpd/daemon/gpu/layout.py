"""Which devices each rank of a GPU job uses, and what its environment says of them. Pure.

A job's `Job.gpus` lists, in rank order, each rank's devices as ``CUDA_VISIBLE_DEVICES`` names
them (`GpuInfo.entry`): rank r's are ``gpus[r*k : r*k+k]`` with k devices per rank
(`protocol.spec.rank_gpus`: k whole GPUs, or one shared GPU for a fraction, so ranks that share
one GPU name the same entry).

- The built-in loop's rank sees only its own devices (``cuda:0``.. are its own).
- A script's rank sees all the job's devices, each once, in order: torchrun's layout, so that an
  unmodified script's ``set_device(LOCAL_RANK)`` works with one GPU per rank. Its own devices are
  in ``DDPD_CUDA_DEVICES`` (ordinals within what it sees, comma-separated): with k > 1 rank 1's are
  ``2,3``, not ``cuda:1`` (`set_device(LOCAL_RANK)` would give it rank 0's second GPU); with a
  fraction, ranks sharing a GPU have the same ordinal.
"""

from __future__ import annotations

from ...protocol import JobSpec
from ...protocol.spec import rank_gpus

OWN_DEVICES_ENV = "DDPD_CUDA_DEVICES"


def own_entries(gpus: list[str], spec: JobSpec, rank: int) -> list[str]:
    """The devices local rank `rank` was given (entries of `gpus`)."""
    k, _ = rank_gpus(spec.gpus_per_rank)
    return gpus[rank * k:(rank + 1) * k] if k else []


def job_entries(gpus: list[str]) -> list[str]:
    """The job's distinct devices, in the order its ranks were given them."""
    return list(dict.fromkeys(gpus))


def rank_visible(gpus: list[str], spec: JobSpec, rank: int) -> tuple[str, str]:
    """(``CUDA_VISIBLE_DEVICES``, ``DDPD_CUDA_DEVICES``) of local rank `rank`; ("", "") without GPUs."""
    own = own_entries(gpus, spec, rank)
    if not own:
        return "", ""
    seen = job_entries(gpus) if spec.script is not None else own
    return ",".join(seen), ",".join(str(seen.index(e)) for e in own)
