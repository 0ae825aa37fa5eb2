"""Joining the job: a process group from the launcher's environment (torchrun, SLURM)."""

from __future__ import annotations

import atexit
import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpipe.distributed.mesh import device
from gpipe.distributed.restarts import attempt

__all__ = ["attempt", "device", "init", "spawn"]

_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# SLURM's names for what torchrun sets, for `srun python train.py` without torchrun.
_SLURM = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"}


def init(
    backend: str | None = None, *, timeout: float | datetime.timedelta = 300.0
) -> tuple[int, int]:
    """Join the job: ``init_process_group`` from the environment torchrun (or SLURM) sets.

    torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Under ``srun``
    without torchrun, RANK, WORLD_SIZE and LOCAL_RANK come from SLURM_PROCID, SLURM_NTASKS
    and SLURM_LOCALID; MASTER_ADDR and MASTER_PORT must still be set (see
    docs/distributed.md). With CUDA, each rank takes ``cuda:LOCAL_RANK`` and NCCL; without,
    gloo on the CPU. Calling it again returns the same answer.

    Args:
        backend: "gloo" or "nccl"; by default NCCL when CUDA is present, else gloo.
        timeout: seconds (or a timedelta) a collective may wait before failing.

    Returns:
        ``(rank, world_size)``.

    Raises:
        RuntimeError: the launcher's variables are missing (the message says how to launch).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    for name, slurm in _SLURM.items():
        if name not in os.environ and slurm in os.environ:
            os.environ[name] = os.environ[slurm]
    missing = [name for name in _NEEDED if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"gpipe.distributed.init() found no {', '.join(missing)} in the environment: "
            "launch with torchrun, e.g. `torchrun --nproc-per-node 4 train.py`, or under "
            "SLURM with MASTER_ADDR and MASTER_PORT exported (see docs/distributed.md)"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device())
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    # NOTE: on NCCL, bound to this rank's GPU at once (every communicator made eagerly, on
    # the right device); gloo takes no device.
    bound = device() if backend == "nccl" else None
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout, device_id=bound)
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend, timeout=timeout, device_id=bound, store=store, rank=rank, world_size=world
        )
    atexit.register(_shutdown)
    return dist.get_rank(), dist.get_world_size()


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun's restarts, its agent's store, with keys of this attempt's own.

    NOTE: torchrun hands every attempt of the job the same store, and the process group's
    keys do not name the attempt, so the addresses a dead attempt's ranks published are
    still there: a restarted rank that asks before its peer has published again connects
    to the dead peer's port (measured with torch 2.13 and gloo, plain torch too: every
    restart failed when rank 0 came up 3 s late; once, a restart hung).
    """
    if (
        "TORCHELASTIC_RESTART_COUNT" not in os.environ
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):
        return None
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"gpipe/attempt-{attempt()}", agent)


def _shutdown() -> None:
    """At exit: stop the pipes' threads, then destroy the process group ``init`` made.

    NOTE: a process that exits with its groups alive may abort in their C++ teardown
    (measured: 2 exits in 6 after one extra group); destroying them first does not. After
    a failure a receive may still be pending, and destroying would wait for it: then the
    groups are left as they are.
    """
    from gpipe.distributed.guard import close_all

    if close_all() and dist.is_initialized():
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], nprocs: int, *args: Any, threads: int | None = None
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nprocs`` new processes on this machine, as torchrun would.

    Uses torch's own elastic launcher (``torch.distributed.launcher``): each process gets
    torchrun's environment, so ``fn`` starts with :func:`init`. For commands and benchmarks
    that start their own processes; a training script is better launched with torchrun.

    Args:
        fn: a module-level (picklable) function.
        nprocs: how many processes.
        args: picklable arguments for every process.
        threads: intra-op threads per process (OMP_NUM_THREADS); default: the cores shared
            out, at least one.

    Returns:
        Each rank's return value.

    Raises:
        ValueError: ``nprocs`` below 1.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a process failed
            (its traceback is in the message).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a whole number >= 1, got {nprocs!r}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"gpipe-{os.getpid()}-{port}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
    )
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        return dict(elastic_launch(config, entrypoint=fn)(*args))
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous
