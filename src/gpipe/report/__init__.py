"""``gpipe report``: the measured textbook of pipeline parallelism, one section per module."""
