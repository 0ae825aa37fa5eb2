"""Draw the guide's concept pictures with gpipe itself (simulated timelines, no torch),
then shrink every picture under docs/ to a 64-colour palette, so the repository stays small.

    python docs/pictures.py          # run last by `make docs-pictures`
"""

from __future__ import annotations

from pathlib import Path

from gpipe.analysis import Costs, simulate
from gpipe.schedule import make_schedule

IMAGES = Path(__file__).parent / "images"
COSTS = Costs(forward=1.0, backward=2.0)


def main() -> None:
    # Model parallelism without micro-batches, then GPipe's micro-batches: the bubble shrinks.
    naive = simulate(make_schedule("gpipe", 4, 1), COSTS)
    piped = simulate(make_schedule("gpipe", 4, 8), COSTS)
    naive.plot(
        IMAGES / "concepts-microbatches.png",
        compare=piped,
        names=["one batch (M=1): model parallelism", "8 micro-batches (M=8): GPipe"],
        memory=False,
        title="4 devices, F = 1, B = 2: the bubble before and after micro-batching",
    )
    # The same 8 micro-batches under GPipe and 1F1B: same bubble, less memory held.
    for name, what in [
        ("gpipe", "all forwards, then all backwards"),
        ("1f1b", "a backward as soon as it can"),
    ]:
        simulate(make_schedule(name, 4, 8), COSTS).plot(
            IMAGES / f"concepts-{name}.png",
            title=f"{name}: {what} (memory in micro-batches held)",
        )
    for path in sorted(IMAGES.parent.rglob("*.png")):
        _shrink(path)
    print(f"wrote the concept pictures to {IMAGES} and shrank every picture under docs/")


def _shrink(path: Path) -> None:
    """The same picture with at most 64 colours (matplotlib's are few and flat)."""
    from PIL import Image

    with Image.open(path) as image:
        if image.mode == "P":
            return  # shrunk already
        small = image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


if __name__ == "__main__":
    main()
