"""Resident memory of torch.distributed alone (no gpipe): what a pipe's step asks of it, repeated.

Two plain processes (gloo, TCPStore hosted by rank 0, as when launched by hand) repeat one
kind of request ``--iterations`` times and report their RSS slope after a warm-up of 20 %:

    store        set / get / check / add / compare_set on fixed keys, on a client of its own
    keys         set on a new key each time (what a store keeps for every key ever written)
    storethread  one set and get on a fixed key, from a new thread each time
    newkey       set then delete a new key each time
    wakekey      the same, while another client waits for the key (as a pipe's watcher)
    p2p          isend / irecv of two small tensors each way, then wait
    thread       the same exchange, on a new thread each time
    sendrecv     group.send / group.recv on tag 0 of a subgroup, waited on one other thread
    broadcast    async broadcast on a subgroup, waited on a new thread each time (as a wait
                 that a failure can interrupt does)

A mode that grows while its control stays flat (broadcast vs sendrecv, thread vs p2p) is
torch's own growth, with no gpipe code running.

    python benchmarks/soak_repro.py                    # broadcast: grows with every thread
    python benchmarks/soak_repro.py --mode sendrecv    # the same kind of waits, one thread: flat
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import subprocess
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

MODES = (
    "store",
    "keys",
    "p2p",
    "thread",
    "sendrecv",
    "broadcast",
    "storethread",
    "wakekey",
    "newkey",
)


def rss() -> int:
    """This process's resident set, in bytes (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares bytes per iteration through (iteration, bytes) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def exchange(rank: int) -> None:
    """Two small tensors each way between ranks 0 and 1, as a 1F1B step's messages."""
    peer = 1 - rank
    outgoing = [torch.randn(2, 8), torch.randn(2, 8)]
    incoming = [torch.empty(2, 8), torch.empty(2, 8)]
    ops = [dist.P2POp(dist.isend, t, peer) for t in outgoing]
    ops += [dist.P2POp(dist.irecv, t, peer) for t in incoming]
    works = dist.batch_isend_irecv(ops if rank == 0 else ops[2:] + ops[:2])
    for work in works:
        work.wait()


def sendrecv(group: Any, rank: int, waiter: queue.SimpleQueue[Any]) -> None:
    """Two small tensors each way, posted on the group, waited by another thread."""
    peer = 1 - rank
    works = [group.send([torch.randn(2, 8)], peer, 0) for _ in range(2)]
    works += [group.recv([torch.empty(2, 8)], peer, 0) for _ in range(2)]
    done = threading.Event()
    waiter.put((works, done))
    done.wait()


def wait_all(waiter: queue.SimpleQueue[Any]) -> None:
    while (job := waiter.get()) is not None:
        works, done = job
        for work in works:
            work.wait()
        del works, work
        done.set()


def broadcast(group: Any, rank: int) -> None:
    """An async broadcast from rank 0, waited on a new thread."""
    work = dist.broadcast(torch.arange(16.0), 0, group, async_op=True)
    held = [work]
    del work
    helper = threading.Thread(target=lambda: held.pop().wait())
    helper.start()
    helper.join()


def ask(client: Any, key: str) -> None:
    client.set(key, b"x" * 200)
    client.get(key)


def worker(mode: str, iterations: int, every: int) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    group, _ = dist.new_subgroups_by_enumeration([[0, 1]])
    waiter: queue.SimpleQueue[Any] = queue.SimpleQueue()
    threading.Thread(target=wait_all, args=(waiter,), daemon=True).start()
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    client = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False)
    other = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False)
    samples = []
    for i in range(1, iterations + 1):
        if mode == "store":
            key = f"repro/{rank}"
            client.set(key, b"x" * 200)
            client.get(key)
            client.check([key])
            client.add(f"{key}/count", 1)
            client.compare_set(f"{key}/cas", b"", b"y")
        elif mode == "keys":
            client.set(f"repro/{rank}/{i}", b"x" * 200)
        elif mode == "p2p":
            exchange(rank)
        elif mode == "sendrecv":
            sendrecv(group, rank, waiter)
        elif mode == "broadcast":
            broadcast(group, rank)
        elif mode in ("newkey", "wakekey"):
            key = f"repro/{rank}/wake/{i}"
            if mode == "wakekey":
                watcher = threading.Thread(target=other.wait, args=([key],))
                watcher.start()
            client.set(key, b"closed")
            if mode == "wakekey":
                watcher.join()
            client.delete_key(key)
        elif mode == "storethread":
            asker = threading.Thread(target=ask, args=(client, f"repro/{rank}"))
            asker.start()
            asker.join()
        else:
            done = threading.Thread(target=exchange, args=(rank,))
            done.start()
            done.join()
        if i % every == 0:
            samples.append((i, rss()))
    dist.barrier()
    after = [p for p in samples if p[0] >= iterations // 5]
    print(
        f"rank {rank} mode={mode} iterations={iterations} "
        f"bytes_per_iteration={slope(after):.1f} "
        f"growth_mib={(after[-1][1] - after[0][1]) / 2**20:.3f}",
        flush=True,
    )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="broadcast")
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--every", type=int, default=500, help="iterations between samples")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.mode, args.iterations, args.every)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    command = [sys.executable, __file__, "--worker", "--mode", args.mode]
    command += ["--iterations", str(args.iterations), "--every", str(args.every)]
    procs = [
        subprocess.Popen(
            command,
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=args.timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [line for out in outputs for line in out.splitlines()]
    print("\n".join(lines))
    fields = [dict(f.split("=") for f in line.split()[2:]) for line in lines]
    if len(fields) == 2:
        print(
            f"RESULT mode={args.mode} iterations={args.iterations} "
            + " ".join(
                f"rank{r}_bytes_per_iteration={f['bytes_per_iteration']}"
                for r, f in enumerate(fields)
            )
        )
    sys.exit(max(proc.returncode for proc in procs))


if __name__ == "__main__":
    main()
