"""Random streams: every (layer, micro-batch) draws from its own, whatever the threads do.

Stages in one process share a device's default generator (every "cpu" stage shares the one
CPU generator), so concurrent stages would draw dropout masks in an order that changes from
run to run, and a recomputation that merely restores "the RNG state" would replay masks
another thread drew in between. Instead, each layer of the user's model draws, for each
micro-batch, from a stream seeded from (step seed, layer key, micro-batch index) alone: the
masks do not depend on the balance, the schedule, the device count, the thread or the order
of execution, a recomputation replays them exactly, and no lock is held across a stage's
forward, so stages that draw run concurrently like any others.

A layer's key is its position in the user's ``nn.Sequential`` (an int), or a qualified
submodule name (a str) for models split by name. :func:`layer_stream` runs plain code on the
same streams, so a pipe's masks can be reproduced without the pipe.

    seeds       the step seed and each stream's seed
    generators  the devices' default generators: which a worker owns, which it shares
    routing     the dispatch mode that hands random ops a stream's private generator
    streams     how each layer draws, learned as it runs, and the scope it runs in
"""

from gpipe.randomness.routing import layer_stream
from gpipe.randomness.seeds import LOSS_KEY, LayerKey, draw_step_seed, stream_seed
from gpipe.randomness.streams import Streams

__all__ = ["LOSS_KEY", "LayerKey", "Streams", "draw_step_seed", "layer_stream", "stream_seed"]
