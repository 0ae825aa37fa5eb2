"""What the ranks of the Hugging Face tests run: a model from ``transformers`` split by
gpipe.split and trained by DistributedGPipe, against plain training in the same process."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gpipe
import gpipe.distributed as gd
from hf_models import build, case, loss


def seeded_init(model: Any) -> Callable[[nn.Module], None]:
    """Hugging Face's own ``_init_weights``, with the global seed set from each module's
    name first, so a model built on meta and one built normally draw the same values. It
    knows the user's modules only: one it was not given, it leaves alone."""
    names = {id(m): name for name, m in model.named_modules()}

    def init_fn(module: nn.Module) -> None:
        if id(module) in names:
            torch.manual_seed(zlib.crc32(names[id(module)].encode()))
            model._init_weights(module)

    return init_fn


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def trains_like_plain(name: str, schedules: list[str], meta: bool) -> Any:
    """For each schedule: loss and this rank's gradients of a split model (built on meta
    and initialized by its own ``_init_weights`` if ``meta``) against plain training."""
    this = case(name)
    (ids, kwargs), target = this.inputs(), this.target()
    results: dict[str, Any] = {}
    for schedule in schedules:
        if meta:
            with torch.device("meta"):
                model = this.build().double()
        else:
            model = build(name)
        stages = gpipe.split(
            model,
            split_points=this.split_points,
            example_inputs=(ids,),
            example_kwargs=kwargs,
            leaf_modules=this.leaf_modules,
        )
        pipe = gd.DistributedGPipe(
            stages,
            chunks=2,
            schedule=schedule,
            init_fn=seeded_init(model) if meta else None,
            timeout=60,
        )
        got = pipe.train_step(ids, target, loss, kwargs=kwargs or None)
        plain = build(name)
        if meta:
            init_fn = seeded_init(plain)
            plain.apply(init_fn)
            for module in _homes_of_ties(plain):
                init_fn(module)  # a tied weight takes its first holder's values
        expected = loss(plain(ids, **kwargs), target)
        expected.backward()
        reference = dict(plain.named_parameters(remove_duplicate=False))
        grad, trained = 0.0, []
        for param_name, param in model.named_parameters():
            if param.is_meta:
                continue
            assert param.grad is not None, f"{param_name} got no gradient"
            grad = max(grad, _diff(param.grad, reference[param_name].grad))
            trained.append(param_name)
        results[schedule] = {"loss": _diff(got, expected), "grad": grad, "trained": trained}
        pipe.close()
    return results


def _homes_of_ties(model: nn.Module) -> list[nn.Module]:
    """The first module holding each parameter that several modules hold."""
    first: dict[int, nn.Module] = {}
    tied: list[nn.Module] = []
    for _, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if id(param) in first and first[id(param)] not in tied:
                tied.append(first[id(param)])
            first.setdefault(id(param), module)
    return tied


def loads_safetensors_into_a_meta_pipe(folder: str) -> Any:
    """GPT-2 built on meta, each rank's weights copied by name from a safetensors file
    (written by the test from a model built normally); then a checkpoint of the pipe,
    consolidated, loads into the Hugging Face class with strict=True."""
    import os

    import torch.distributed as dist
    import transformers as hf
    from safetensors import safe_open

    this = case("gpt2")
    (ids, _), target = this.inputs(), this.target()
    with torch.device("meta"):
        model = this.build().double()
    stages = gpipe.split(model, split_points=this.split_points, example_inputs=(ids,))
    pipe = gd.DistributedGPipe(stages, chunks=2, schedule="1f1b", timeout=60)
    tied = model.all_tied_weights_keys
    with (
        safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as weights,
        torch.no_grad(),
    ):
        for name, param in model.named_parameters():
            if not param.is_meta:
                param.copy_(weights.get_tensor(tied.get(name, name)))
    got = pipe.train_step(ids, target, loss)
    plain = hf.GPT2LMHeadModel.from_pretrained(folder).double().train()
    expected = loss(plain(ids), target)
    expected.backward()
    reference = dict(plain.named_parameters())
    grad = max(
        _diff(p.grad, reference[tied.get(n, n)].grad)
        for n, p in model.named_parameters()
        if not p.is_meta
    )
    pipe.save(os.path.join(folder, "checkpoint"))
    strict = ""
    if dist.get_rank() == 0:
        gd.consolidate(os.path.join(folder, "checkpoint"), os.path.join(folder, "trained.pt"))
        trained = this.build().double()
        try:
            trained.load_state_dict(torch.load(os.path.join(folder, "trained.pt")), strict=True)
        except RuntimeError as error:
            strict = str(error)
        else:
            same = all(torch.equal(a, b) for a, b in zip(trained.parameters(), plain.parameters()))
            strict = "" if same else "the consolidated weights differ from the loaded ones"
    pipe.close()
    return {"loss": _diff(got, expected), "grad": grad, "strict": strict}
