"""Balancing: profile each layer, then cut the model where every stage costs about the same.

As in torchgpipe, ``balance_by_time(module, sample, stages)`` gives the ``balance`` argument of
:class:`gpipe.GPipe`; ``GPipe(balance="time", sample=...)`` calls it for you.
"""

from gpipe.balance.exact import balance_costs, balance_weighted
from gpipe.balance.layer_profile import Profile
from gpipe.balance.measured import balance_by_memory, balance_by_params, balance_by_time
from gpipe.balance.profiler import profile

__all__ = [
    "Profile",
    "balance_by_memory",
    "balance_by_params",
    "balance_by_time",
    "balance_costs",
    "balance_weighted",
    "profile",
]
