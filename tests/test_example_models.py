"""The example models of gpipe.models: their shapes, their structure, and that they learn."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

from gpipe.models import (
    GPT2Config,
    ResNetConfig,
    Seq2SeqConfig,
    UNetConfig,
    gpt2,
    gpt_loss,
    resnet,
    seq2seq,
    seq2seq_loss,
    unet,
)


def _gpt2_task() -> tuple[nn.Module, tuple, dict, Callable[[], torch.Tensor]]:
    model = gpt2(GPT2Config()).double()
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, -3:] = 0
    return model, (idx,), {"attention_mask": mask}, lambda: torch.roll(idx, -1, dims=1)


def _resnet_task() -> tuple[nn.Module, tuple, dict, Callable[[], torch.Tensor]]:
    model = resnet(ResNetConfig()).double()
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)).double()
    return model, (images,), {}, lambda: torch.arange(8) % 10


def _unet_task() -> tuple[nn.Module, tuple, dict, Callable[[], torch.Tensor]]:
    model = unet(UNetConfig()).double()
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)).double()
    return model, (images,), {}, lambda: images.flip(-1)


def _seq2seq_task() -> tuple[nn.Module, tuple, dict, Callable[[], tuple]]:
    model = seq2seq(Seq2SeqConfig()).double()
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(0, 64, (4, 12), generator=generator)
    tgt = torch.randint(0, 64, (4, 10), generator=generator)
    return model, (src, tgt), {}, lambda: (torch.roll(tgt, -1, dims=1), src)


def _loss(name: str, output: object, target: object) -> torch.Tensor:
    if name == "gpt2":
        return gpt_loss(output, target)  # type: ignore[arg-type]
    if name == "resnet":
        return F.cross_entropy(output, target)  # type: ignore[arg-type]
    if name == "unet":
        return F.mse_loss(output, target)  # type: ignore[arg-type]
    return seq2seq_loss(output, target)  # type: ignore[arg-type]


TASKS = {"gpt2": _gpt2_task, "resnet": _resnet_task, "unet": _unet_task, "seq2seq": _seq2seq_task}


def test_each_model_maps_its_inputs_to_the_documented_shapes() -> None:
    model, (idx,), kwargs, _ = _gpt2_task()
    assert model(idx, **kwargs).shape == (4, 16, 64)
    model, (images,), _, _ = _resnet_task()
    assert model(images).shape == (8, 10)
    model, (images,), _, _ = _unet_task()
    assert model(images).shape == (4, 3, 16, 16)
    model, (src, tgt), _, _ = _seq2seq_task()
    logits, src_logits = model(src, tgt)
    assert logits.shape == (4, 10, 64) and src_logits.shape == (4, 12, 64)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_one_optimizer_step_lowers_the_loss(name: str) -> None:
    model, args, kwargs, target = TASKS[name]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    before = _loss(name, model(*args, **kwargs), target())
    before.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    optimizer.step()
    after = _loss(name, model(*args, **kwargs), target())
    assert after < before - 1e-3


@pytest.mark.parametrize("build", [gpt2, resnet, unet, seq2seq])
def test_the_seed_decides_the_weights_and_leaves_the_global_state_alone(
    build: Callable[..., nn.Module],
) -> None:
    torch.manual_seed(7)
    state = torch.get_rng_state()
    first, again, other = build(seed=3), build(seed=3), build(seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    for a, b in zip(first.parameters(), again.parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(first.parameters(), other.parameters()))


def test_gpt2_has_gpt2s_parameter_names() -> None:
    names = set(gpt2(GPT2Config(n_layer=2)).state_dict())
    for name in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.1.ln_1.weight",
        "transformer.h.1.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.bias",
        "transformer.h.1.ln_2.bias",
        "transformer.h.1.mlp.c_fc.weight",
        "transformer.h.1.mlp.c_proj.weight",
        "transformer.ln_f.weight",
        "lm_head.weight",
    ]:
        assert name in names, name
    assert not any(name.startswith("transformer.h.2") for name in names)


def test_gpt2s_head_is_its_token_embedding() -> None:
    model, (idx,), _, target = _gpt2_task()
    assert model.lm_head.weight is model.transformer.wte.weight
    named = dict(model.named_parameters())
    assert "lm_head.weight" not in named  # listed once, under its first name
    gpt_loss(model(idx), target()).backward()
    grad = model.transformer.wte.weight.grad
    # The gradient sums both uses: rows of tokens never read still get the head's share.
    unread = sorted(set(range(64)) - set(idx.flatten().tolist()))
    assert unread and grad[unread].abs().sum() > 0


def test_gpt2s_mask_hides_padding_and_all_ones_is_no_mask() -> None:
    model, (idx,), _, _ = _gpt2_task()
    ones = torch.ones_like(idx)
    torch.testing.assert_close(model(idx, attention_mask=ones), model(idx))
    mask = ones.clone()
    mask[:, :4] = 0  # left padding
    changed = idx.clone()
    changed[:, :4] = (idx[:, :4] + 1) % 64
    masked, masked_changed = model(idx, attention_mask=mask), model(changed, attention_mask=mask)
    # With the mask, what the padding holds cannot reach the tokens; without it, it does.
    torch.testing.assert_close(masked[:, 4:], masked_changed[:, 4:])
    assert not torch.allclose(model(idx)[:, 4:], model(changed)[:, 4:])
    assert not torch.allclose(masked[:, 4:], model(idx)[:, 4:])
    assert torch.isfinite(masked).all()


def test_gpt2_is_causal() -> None:
    model, (idx,), _, _ = _gpt2_task()
    changed = idx.clone()
    changed[:, 10] = (idx[:, 10] + 1) % 64
    out, out_changed = model(idx), model(changed)
    torch.testing.assert_close(out[:, :10], out_changed[:, :10])
    assert not torch.allclose(out[:, 10:], out_changed[:, 10:])


def test_resnets_batchnorm_uses_the_batch_in_training_and_running_stats_in_eval() -> None:
    model, (images,), _, _ = _resnet_task()
    bn = model.stem[1]
    assert isinstance(bn, nn.BatchNorm2d)
    other = images.clone()
    other[1:] *= 3.0  # the same first image among different others
    model.train()
    before = bn.running_mean.clone()
    first, first_other = model(images)[0], model(other)[0]
    assert not torch.allclose(first, first_other)  # batch statistics: the others matter
    assert not torch.equal(bn.running_mean, before)  # and running statistics are updated
    assert int(bn.num_batches_tracked) == 2
    model.eval()
    frozen = bn.running_mean.clone()
    torch.testing.assert_close(model(images)[0], model(other)[0])  # each image on its own
    torch.testing.assert_close(model(images[:1])[0], model(images)[0])
    assert torch.equal(bn.running_mean, frozen)


class _BlockTracer(fx.Tracer):
    """Traces a model down to its blocks: ``down.0``, not the convolutions inside it."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return qualified_name.count(".") == 1 or super().is_leaf_module(module, qualified_name)


def _module_users(model: nn.Module, target: str) -> set[str]:
    """The blocks that read block ``target``'s output, directly, in the traced graph."""
    graph = _BlockTracer().trace(model)
    node = next(n for n in graph.nodes if n.op == "call_module" and n.target == target)
    return {str(user.target) for user in node.users if user.op == "call_module"}


def test_unets_long_skips_join_each_down_block_to_its_mirror() -> None:
    model = unet(UNetConfig())
    for i in range(4):  # and the pooling before the next down block, a function
        assert _module_users(model, f"down.{i}") == {f"up.{3 - i}"}


def test_seq2seqs_memory_is_read_by_every_decoder_block_and_both_outputs_train() -> None:
    model, (src, tgt), _, _ = _seq2seq_task()
    graph = fx.symbolic_trace(model).graph
    memory = next(n for n in graph.nodes if n.op == "call_module" and n.target == "ln_memory")
    readers = {str(u.target) for u in memory.users if u.op == "call_module"}
    assert {"decoder.0.cross_attn.kv", "decoder.1.cross_attn.kv", "aux_head"} <= readers
    _, src_logits = model(src, tgt)
    F.cross_entropy(src_logits.flatten(0, 1), src.flatten()).backward()
    assert model.encoder[0].attn.q.weight.grad is not None  # the auxiliary output trains
    assert model.decoder[0].mlp[0].weight.grad is None  # the encoder alone
    tgt_changed = (tgt + 1) % 64
    torch.testing.assert_close(model(src, tgt_changed)[1], src_logits)


def test_resnet_refuses_mismatched_widths_and_blocks() -> None:
    with pytest.raises(ValueError, match=r"widths \(8, 16\) and blocks \(1,\)"):
        resnet(ResNetConfig(widths=(8, 16), blocks=(1,)))
