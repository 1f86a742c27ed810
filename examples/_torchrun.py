"""Joining and leaving torchrun's process group, for the examples that run either way.

Run with ``python``, such an example is one process; run with ``torchrun`` (which sets ``RANK``,
``WORLD_SIZE``, ...), each process joins the gloo group and the loader splits the data by rank.
"""

from __future__ import annotations

import os

import torch.distributed as dist


def join() -> tuple[bool, int]:
    """``(distributed, rank)``: under torchrun, this process joins the gloo process group;
    otherwise ``(False, 0)``."""
    distributed = "RANK" in os.environ  # under torchrun
    if distributed:
        dist.init_process_group("gloo")
    return distributed, dist.get_rank() if distributed else 0


def leave(distributed: bool) -> None:
    """Leave the process group (if joined) once every rank is done with it."""
    if distributed:
        dist.barrier()  # every rank done with gloo before any tears it down (see README)
        dist.destroy_process_group()
