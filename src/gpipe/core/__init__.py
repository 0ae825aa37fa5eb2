"""The step core: what :class:`~gpipe.GPipe` and
:class:`~gpipe.distributed.DistributedGPipe` share, written once.

A step binds the caller's inputs, cuts them into micro-batches (:func:`gpipe.microbatch.
split_batch`), cuts and weights the targets (:mod:`gpipe.core.targets`), binds the
schedule's actions to this process's stages and runs them (:class:`gpipe.core.pipe_core.
PipeCore`), and predicts itself from its measured costs (:func:`gpipe.analysis.prediction.
predict`). The two pipes differ only in where stages live and how messages travel.
"""
