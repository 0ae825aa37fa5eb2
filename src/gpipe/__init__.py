"""gpipe: pipeline-parallel training for PyTorch.

    from gpipe import GPipe
    pipe = GPipe(nn.Sequential(...), balance=[2, 3, 3], chunks=8)
    loss = pipe.train_step(x, target, loss_fn)
"""

from gpipe.balance import balance_costs
from gpipe.microbatch import gather, scatter
from gpipe.partition import balance_by_params
from gpipe.pipe import GPipe
from gpipe.schedule import Action, Schedule, make_schedule
from gpipe.timeline import Event, Timeline

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Event",
    "GPipe",
    "Schedule",
    "Timeline",
    "balance_by_params",
    "balance_costs",
    "gather",
    "make_schedule",
    "scatter",
]
