"""Memory: what the timeline counts, what the planner predicts, what the process really holds.

An activation-dominated model (16 x Linear(256)+GELU, float32, batch 16384 by default) trains
one step as a K=4, M=8 pipeline under each schedule and checkpoint mode, each configuration
in a fresh process so peaks don't mix. Per configuration:

- rss: peak resident memory of the step above what the process held before it (the model,
  its gradients and a warm-up step's threads and caches). Read from /proc/self/status
  VmHWM after resetting it (``echo 5 > /proc/self/clear_refs``), with ``malloc_trim(0)``
  before the reset so memory the warm-up freed but glibc kept does not hide in the
  baseline. RSS is what the machine has to provide, allocator and all.
- live: the most bytes glibc's malloc had handed out and not yet freed (``mallinfo2``:
  in-use heap blocks plus mmapped blocks, summed over all arenas), sampled every 0.2 ms
  from a thread of its own. It holds every tensor, counted or not, but no free memory the
  allocator keeps, so ``rss - live`` is the allocator's share; sampling can miss a peak
  shorter than 0.2 ms.
- counted: the most bytes ``pipe.timeline`` holds across all devices at one moment (the
  devices' counts added up at every action start), and the sum of the per-device peaks.
- planned: what ``gpipe.plan`` predicts for the same pipe (sum of per-device peaks).
- in flight: the most bytes of stage outputs and gradients waiting in the mailboxes between
  stages (not counted by the timeline: how long they wait depends on timing).
- plain: the same step in plain PyTorch, whole batch (the ideal's memory without a
  pipeline), and as M micro-batches one after another (gradient accumulation).

torch.distributed.pipelining is left out here: it runs one process per stage, and adding
up several processes' RSS (each with its own copy of the runtime) measures something else.

    python benchmarks/memory.py                        # gpipe, 1f1b, zb-h1 x 3 modes
    python benchmarks/memory.py --schedules gpipe --batch 4096
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import subprocess
import sys
import threading
import time
from typing import Any

MIB = 2**20
MODES = ("never", "except_last", "always")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b,zb-h1")
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(json.loads(args.child))))
        return
    if not sys.platform.startswith("linux"):
        sys.exit("memory.py reads /proc/self: it runs on Linux")
    shape = {"batch": args.batch, "width": args.width, "blocks": args.blocks}
    configs = [{"schedule": "plain", "mode": mode, **shape} for mode in ("whole", "accumulate")]
    configs += [
        {"schedule": s, "mode": mode, **shape} for s in args.schedules.split(",") for mode in MODES
    ]
    rows = [_run(config) for config in configs]
    header = (
        f"{'schedule':<9} {'checkpoint':<11} {'rss':>6} {'live':>6} {'counted':>8} "
        f"{'dev-sum':>8} {'planned':>8} {'inflight':>8} {'rss-count':>9} {'live-count':>10}"
    )
    print(f"peak MiB above the model, K=4 M=8, {args.blocks} x Linear({args.width})+GELU, "
          f"batch {args.batch}, float32 (one fresh process each)")  # fmt: skip
    print(header)
    for row in rows:
        print(_format(row))
    _print_result(rows)


def _run(config: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", json.dumps(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        sys.exit(f"{config}: the child failed:\n{done.stderr}")
    return {**config, **json.loads(done.stdout.strip().splitlines()[-1])}


def _format(row: dict[str, Any]) -> str:
    def mib(key: str) -> str:
        value = row.get(key)
        return "-" if value is None else f"{value / MIB:.0f}"

    def diff(a: str, b: str) -> str:
        if row.get(a) is None or row.get(b) is None:
            return "-"
        return f"{(row[a] - row[b]) / MIB:+.0f}"

    return (
        f"{row['schedule']:<9} {row['mode']:<11} {mib('rss'):>6} {mib('live'):>6} "
        f"{mib('counted'):>8} {mib('device_sum'):>8} {mib('planned'):>8} "
        f"{mib('in_flight'):>8} {diff('rss', 'counted'):>9} {diff('live', 'counted'):>10}"
    )


def _print_result(rows: list[dict[str, Any]]) -> None:
    def find(schedule: str, mode: str) -> dict[str, Any] | None:
        return next((r for r in rows if (r["schedule"], r["mode"]) == (schedule, mode)), None)

    fields: dict[str, str] = {}
    for row in rows:
        key = f"{row['schedule']}_{row['mode']}".replace("-", "")
        fields[f"{key}_rss_mib"] = f"{row['rss'] / MIB:.0f}"
        if row.get("counted") is not None:
            fields[f"{key}_counted_mib"] = f"{row['counted'] / MIB:.0f}"
    never, always = find("gpipe", "never"), find("gpipe", "always")
    if never and always:
        fields["gpipe_cut_rss"] = f"{1 - always['rss'] / never['rss']:.3f}"
        fields["gpipe_cut_counted"] = f"{1 - always['counted'] / never['counted']:.3f}"
    exact = all(r["planned"] == r["device_sum"] for r in rows if r.get("planned") is not None)
    fields["planned_equals_counted"] = str(exact).lower()
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()))


# -- one configuration, in its own process --------------------------------------------------


def _measure(config: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    # NOTE: one intra-op thread per worker, as gpipe demo does: the workers are the
    # parallelism, and the figures then do not depend on the machine's core count.
    torch.set_num_threads(1)
    width, batch, m = config["width"], config["batch"], 8
    layers: list[nn.Module] = []
    for _ in range(config["blocks"]):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers)

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, width), torch.randn(batch, width)

    result: dict[str, Any] = {}
    pipe = None
    if config["schedule"] == "plain":
        parts = 1 if config["mode"] == "whole" else m

        def step(x: torch.Tensor, target: torch.Tensor) -> None:
            for xs, ts in zip(x.chunk(parts), target.chunk(parts)):
                (F.mse_loss(model(xs), ts) * (xs.shape[0] / batch)).backward()

    else:
        from gpipe import GPipe, plan

        sample = torch.randn(batch // m, width)
        report = plan(
            model,
            sample,
            batch,
            ["cpu"] * 4,
            loss_fn=F.mse_loss,
            target=torch.randn(batch // m, width),
            schedules=[config["schedule"]],
            chunks=[m],
            checkpoints=[config["mode"]],
            top=100,
            progress=False,
            repeats=1,
            action_overhead=0,
        )
        chosen = next(p for p in report if p.stages == 4)
        pipe = GPipe.from_plan(model, chosen)
        result["planned"] = sum(chosen.activation_memory)
        in_flight = _watch_mailboxes(pipe)

        def step(x: torch.Tensor, target: torch.Tensor) -> None:
            pipe.train_step(x, target, F.mse_loss)

    step(*data())  # warm-up: threads, caches, parameter gradients
    gc.collect()
    heap = _Heap()
    heap.trim()
    _reset_peak()
    base_rss, base_live = _status("VmRSS"), heap.live()
    if pipe is not None:
        in_flight["now"] = in_flight["peak"] = 0
    with heap.sampling() as live_peak:
        step(*data())
    result["rss"] = _status("VmHWM") - base_rss
    result["live"] = None if live_peak[0] is None else live_peak[0] - base_live
    if pipe is not None:
        timeline = pipe.timeline
        result["counted"] = _together(timeline)
        result["device_sum"] = sum(timeline.peak_memory)
        result["in_flight"] = in_flight["peak"]
    return result


def _together(timeline: Any) -> int:
    """The most bytes all devices' counts add up to at one moment (at an action's start)."""
    moments = sorted({e.start for device in timeline.events for e in device})
    best = 0
    for moment in moments:
        total = 0
        for events in timeline.events:
            now = [e.memory for e in events if e.start <= moment]
            total += now[-1] if now else 0
        best = max(best, total)
    return int(best)


def _watch_mailboxes(pipe: Any) -> dict[str, int]:
    """Track bytes sent between stages and not yet received (not the caller's batch)."""
    from gpipe.runtime.saved import gradient_bytes

    transport, lock = pipe._transport, threading.Lock()
    stages = len(pipe.partitions)
    state = {"now": 0, "peak": 0}
    send, recv = transport.send, transport.recv

    def between_stages(tag: tuple[str, int, int]) -> bool:
        return not (tag[0] == "act" and tag[1] == 0) and 0 <= tag[1] < stages

    def watched_send(tag: tuple[str, int, int], value: Any) -> None:
        if between_stages(tag):
            with lock:
                state["now"] += gradient_bytes(value)
                state["peak"] = max(state["peak"], state["now"])
        send(tag, value)

    def watched_recv(tag: tuple[str, int, int]) -> Any:
        value = recv(tag)
        if between_stages(tag):
            with lock:
                state["now"] -= gradient_bytes(value)
        return value

    transport.send, transport.recv = watched_send, watched_recv
    return state


class _Heap:
    """glibc's view of the heap: trim it, and sample the bytes in use."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("c")
        self._libc = ctypes.CDLL(name) if name else None
        self._info = getattr(self._libc, "mallinfo2", None)
        if self._info is not None:
            self._info.restype = _MallInfo2

    def trim(self) -> None:
        if self._libc is not None and hasattr(self._libc, "malloc_trim"):
            self._libc.malloc_trim(0)

    def live(self) -> int | None:
        if self._info is None:
            return None
        info = self._info()
        return int(info.uordblks + info.hblkhd)

    def sampling(self) -> _Sampler:
        return _Sampler(self)


class _Sampler:
    def __init__(self, heap: _Heap) -> None:
        self._heap, self._stop = heap, threading.Event()
        self.peak: list[int | None] = [heap.live()]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self._heap.live()
            if value is not None and (self.peak[0] is None or value > self.peak[0]):
                self.peak[0] = value
            time.sleep(0.0002)

    def __enter__(self) -> list[int | None]:
        self._thread.start()
        return self.peak

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        ("arena", ctypes.c_size_t),
        ("ordblks", ctypes.c_size_t),
        ("smblks", ctypes.c_size_t),
        ("hblks", ctypes.c_size_t),
        ("hblkhd", ctypes.c_size_t),  # bytes in mmapped blocks
        ("usmblks", ctypes.c_size_t),
        ("fsmblks", ctypes.c_size_t),
        ("uordblks", ctypes.c_size_t),  # bytes in use in the arenas
        ("fordblks", ctypes.c_size_t),
        ("keepcost", ctypes.c_size_t),
    ]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


if __name__ == "__main__":
    main()
