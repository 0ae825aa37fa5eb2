"""Random streams: one per (layer, micro-batch), so every layout draws the same masks."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

from conftest import fresh_python
from gpipe import GPipe
from gpipe.microbatch import scatter
from gpipe.models import GPTConfig, SleepLayer, gpt, gpt_loss, synthetic_tokens
from gpipe.randomness import LOSS_KEY, Streams, draw_step_seed, layer_stream, stream_seed
from gpipe.randomness import streams as streams_module

SEED = 3


class Noise(nn.Module):
    """Adds Gaussian noise: a factory random op (``randn_like``) besides dropout's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x)


def _model(p: float = 0.5) -> nn.Sequential:
    """Eight layers, five of which draw random numbers, in float64."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8),
        nn.Dropout(p),
        nn.Tanh(),
        nn.Linear(8, 8),
        Noise(),
        nn.Dropout(p / 2),
        nn.Linear(8, 8),
        nn.Dropout(p),
    ).double()


X = torch.linspace(-1, 1, 8 * 8, dtype=torch.float64).view(8, 8)
TARGET = torch.zeros(8, 8, dtype=torch.float64)


def _reference(
    model: nn.Sequential, chunks: int, step_seed: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Plain PyTorch over the micro-batches, each layer on its pipe stream: loss and grads."""
    total = torch.zeros((), dtype=torch.float64)
    for m, (x, target) in enumerate(zip(scatter(X, chunks), scatter(TARGET, chunks))):
        for position, layer in enumerate(model):
            with layer_stream(step_seed, position, m):
                x = layer(x)
        with layer_stream(step_seed, LOSS_KEY, m):
            total = total + F.mse_loss(x, target) * (len(target) / len(TARGET))
    total.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return total.detach(), grads


@functools.cache
def _expected(chunks: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = _model()
    torch.manual_seed(SEED)
    return _reference(model, chunks, draw_step_seed())


def _pipe_step(pipe: GPipe, model: nn.Sequential) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(SEED)
    loss = pipe.train_step(X, TARGET, F.mse_loss)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss, grads


LAYOUTS = {  # schedule -> (balances, virtual stages)
    "gpipe": ([[1] * 8, [2, 6], [4, 4], [3, 3, 2], [8]], 1),
    "1f1b": ([[1] * 8, [2, 6], [4, 4], [3, 3, 2]], 1),
    "zb-h1": ([[1] * 8, [2, 6], [4, 4], [3, 3, 2]], 1),
    "interleaved": ([[1] * 8, [2, 6], [4, 4], [2, 2, 2, 2]], 2),
}


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("schedule", list(LAYOUTS))
def test_every_layout_draws_the_masks_of_the_plain_reference(schedule: str, chunks: int) -> None:
    """Balance, devices, schedule, virtual stages, checkpoint: the same loss and gradients."""
    balances, virtual = LAYOUTS[schedule]
    expected_loss, expected_grads = _expected(chunks)
    for balance in balances:
        for checkpoint in ["always", "except_last", "never"]:
            model = _model()
            pipe = GPipe(
                model,
                balance,
                chunks=chunks,
                checkpoint=checkpoint,
                schedule=schedule,
                virtual_stages=virtual,
            )
            loss, grads = _pipe_step(pipe, model)
            layout = f"balance={balance} checkpoint={checkpoint}"
            assert_close(loss, expected_loss, msg=lambda m, layout=layout: f"{layout}: {m}")
            assert_close(grads, expected_grads, msg=lambda m, layout=layout: f"{layout}: {m}")


def test_the_masks_are_not_all_kept() -> None:
    """The reference really drops: its gradients differ from the model without dropout."""
    with_dropout = _reference(_model(), 2, SEED)[1]
    without = _reference(_model(p=0.0), 2, SEED)[1]
    assert not all(torch.equal(a, b) for a, b in zip(with_dropout, without))


def test_pipe_call_and_backward_draw_the_masks_of_train_step() -> None:
    model = _model()
    pipe = GPipe(model, [3, 5], chunks=4, checkpoint="always")
    torch.manual_seed(SEED)
    F.mse_loss(pipe(X), TARGET).backward()
    assert_close([p.grad for p in model.parameters()], _expected(4)[1])


def test_same_seed_gives_bitwise_identical_gradients_across_runs() -> None:
    runs = []
    for _ in range(3):
        model = _model()
        runs.append(_pipe_step(GPipe(model, [2, 3, 3], chunks=4), model)[1])
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_recomputation_replays_the_masks_bitwise(checkpoint: str) -> None:
    model = _model()
    kept = _pipe_step(GPipe(model, [4, 4], chunks=4, checkpoint="never"), model)[1]
    recomputed = _pipe_step(GPipe(model, [4, 4], chunks=4, checkpoint=checkpoint), model)[1]
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


def test_consecutive_steps_and_seeds_draw_different_masks() -> None:
    model = _model()
    pipe = GPipe(model, [4, 4], chunks=2)
    first = _pipe_step(pipe, model)[1]
    pipe.train_step(X, TARGET, F.mse_loss)
    second = [p.grad.clone() for p in model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(first, second))


def test_pipeline_advances_the_global_generator_by_one_draw_per_step() -> None:
    for balance in ([4, 4], [8]):  # shared and owned CPU generator
        pipe = GPipe(_model(), balance, chunks=3, checkpoint="always")
        torch.manual_seed(11)
        pipe.train_step(X, TARGET, F.mse_loss)
        after_step = torch.rand(3)
        torch.manual_seed(11)
        draw_step_seed()
        assert torch.equal(after_step, torch.rand(3))


def test_a_layer_that_starts_drawing_later_is_caught_and_replayed() -> None:
    """Dropout at p=0 draws nothing; raised to 0.5 it must draw on its stream at once."""
    for balance, checkpoint in [([3, 5], "always"), ([3, 5], "never"), ([8], "except_last")]:
        model = _model(p=0.0)
        pipe = GPipe(model, balance, chunks=4, checkpoint=checkpoint)
        for _ in range(3):
            pipe.train_step(X, TARGET, F.mse_loss)
        assert pipe._stages.streams.kind(1, True) == "plain"
        for layer in model:
            if isinstance(layer, nn.Dropout):
                layer.p = 0.5
        model[5].p = 0.25
        model.zero_grad(set_to_none=True)
        loss, grads = _pipe_step(pipe, model)
        assert_close(loss, _expected(4)[0])
        assert_close(grads, _expected(4)[1])
        assert pipe._stages.streams.kind(1, True) in ("routed", "held", "seeded")


@pytest.mark.slow
def test_layers_that_start_drawing_together_on_several_stages_draw_their_own_masks() -> None:
    """Every dropout raised from 0 at once: stages catch their late drawers concurrently, and
    none is timed holding the shared generator while another still draws unrouted on it
    (which drew the other's numbers as its own: about 2 runs in 100 differed)."""
    x = torch.randn(16, 6, dtype=torch.float64)
    target = torch.zeros(16, 2, dtype=torch.float64)
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(6, 6), nn.Dropout(0.0), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(6, 2)).double()

    def late_drawing_output() -> torch.Tensor:
        pipe = GPipe(copy.deepcopy(model), [3, 3, 4], chunks=4, checkpoint="always")
        pipe.train_step(x, target, F.mse_loss)
        for layer in pipe:
            if isinstance(layer, nn.Dropout):
                layer.p = 0.5
        torch.manual_seed(1)
        with torch.no_grad():
            return pipe(x)

    first = late_drawing_output()
    differing = sum(not torch.equal(late_drawing_output(), first) for _ in range(150))
    assert differing == 0


def test_a_late_drawing_layer_counts_its_saved_bytes_once() -> None:
    model = _model(p=0.0)
    pipe = GPipe(model, [4, 4], chunks=2, checkpoint="never")
    pipe.train_step(X, TARGET, F.mse_loss)
    counted = dict(pipe._stages.saved_bytes)
    model[1].p = 0.5
    pipe.train_step(X, TARGET, F.mse_loss)  # redone: counted again next time, not cached
    pipe.train_step(X, TARGET, F.mse_loss)
    same = _model(p=0.0)
    same[1].p = 0.5
    fresh = GPipe(same, [4, 4], chunks=2, checkpoint="never")
    fresh.train_step(X, TARGET, F.mse_loss)
    assert pipe._stages.saved_bytes == fresh._stages.saved_bytes != counted


def test_only_layers_that_draw_run_on_a_stream() -> None:
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.Dropout(0.1),
        nn.Sequential(SleepLayer(20, 0), nn.Dropout(0.1)),
        nn.Tanh(),
    )
    pipe = GPipe(model, [2, 2], chunks=2)
    for _ in range(4):  # probed, then timed three times routed and held
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    kinds = [pipe._stages.streams.kind(i, True) for i in range(4)]
    # a dropout alone is a few small ops: routing them would cost more than holding the
    # shared generator for their few microseconds; a slow layer is routed, never holding it
    assert kinds == ["plain", "held", "routed", "plain"]
    single = GPipe(model, [4], chunks=2)  # one worker owns the CPU generator: no routing
    single.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    assert [single._stages.streams.kind(i, True) for i in range(4)] == [
        "plain",
        "seeded",
        "seeded",
        "plain",
    ]


def test_a_worker_owning_every_generator_probes_without_a_dispatch_mode() -> None:
    # The first dispatch mode a process enters imports torch._dynamo (1.1 s), which landed
    # in the first forward of every one-stage process; such a worker has nothing to route.
    script = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from torch.nn import functional as F\n"
        "from gpipe import GPipe\n"
        "pipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), [2], chunks=2)\n"
        "pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)\n"
        "print(pipe._stages.streams.kind(1, True), 'torch._dynamo' in sys.modules)\n"
    )
    assert fresh_python(script, timeout=120).split() == ["seeded", "False"]


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_routing_or_holding_a_layer_draws_the_same_masks(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = {}
    monkeypatch.setattr(streams_module, "_TRIALS", 1)  # micro-batch 2 settles the way
    for way, threshold in [("routed", float("inf")), ("held", 0.0)]:
        monkeypatch.setattr(streams_module, "_HOLD_ABOVE", threshold)
        model = _model()
        pipe = GPipe(model, [1] * 8, chunks=4, checkpoint=checkpoint)
        runs[way] = _pipe_step(pipe, model)[1]
        assert pipe._stages.streams.kind(1, True) == way
    assert all(torch.equal(a, b) for a, b in zip(runs["routed"], runs["held"]))
    assert_close(runs["routed"], _expected(4)[1])


def test_a_layer_of_many_small_ops_holds_the_generator_rather_than_being_routed() -> None:
    """The tiny GPT's blocks: routing took a block's forward from 0.83 to 1.57 ms of CPU."""
    torch.manual_seed(0)
    config = GPTConfig(layers=2)
    model = gpt(config)
    pipe = GPipe(model, [2, 3], chunks=4, checkpoint="never")
    ids, targets = synthetic_tokens(8, config)
    for _ in range(2):  # probed, then timed three times routed and held
        pipe.train_step(ids, targets, gpt_loss)
    kinds = [pipe._stages.streams.kind(i, True) for i in range(5)]
    assert kinds == ["held", "held", "held", "plain", "plain"]  # embedding, blocks, norm, head


def test_one_layer_object_at_two_positions_draws_two_streams() -> None:
    """Streams follow positions: ``drop`` in ``Sequential(l1, drop, l2, drop)`` draws twice."""

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        drop = nn.Dropout(0.5)
        return nn.Sequential(nn.Linear(8, 8), drop, nn.Linear(8, 8), drop).double()

    reference = model()
    torch.manual_seed(SEED)
    _, expected = _reference(reference, 2, draw_step_seed())
    for balance in ([2, 2], [1, 1, 1, 1], [4]):
        twice = model()
        assert_close(_pipe_step(GPipe(twice, balance, chunks=2), twice)[1], expected)
    x = torch.ones(4, 8, dtype=torch.float64)
    with layer_stream(SEED, 1, 0):
        first = reference[1](x)
    with layer_stream(SEED, 3, 0):
        second = reference[3](x)
    assert not torch.equal(first, second)


class _DrawsOutsideTorchOps(nn.Module):
    """Draws as custom kernels do: one op tagged random but taking no generator (routing
    runs it holding the default generator seeded), one not even tagged (it bypasses routing:
    the layer is then held)."""

    def __init__(self, untagged: bool = True) -> None:
        super().__init__()
        self.untagged = untagged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = _tagged_noise(x.detach())
        if self.untagged:
            noise = noise * _untagged_noise(x.detach())
        return x * noise


# NOTE: ops with no generator argument, drawing from the default generator inside.
@torch.library.custom_op("gpipe_test::untagged_noise", mutates_args=())
def _untagged_noise(x: torch.Tensor) -> torch.Tensor:
    return torch.rand(x.shape, dtype=x.dtype) + 0.5


@torch.library.custom_op(
    "gpipe_test::tagged_noise", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def _tagged_noise(x: torch.Tensor) -> torch.Tensor:
    return torch.rand(x.shape, dtype=x.dtype) + 0.5


def _custom_grads(
    balance: list[int], checkpoint: str, kind: str, untagged: bool = True
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _DrawsOutsideTorchOps(untagged), nn.Linear(8, 8))
    pipe = GPipe(model.double(), balance, chunks=2, checkpoint=checkpoint)
    grads = _pipe_step(pipe, model)[1]
    assert pipe._stages.streams.kind(1, True) == kind
    return grads


def test_draws_that_bypass_routing_are_held_seeded_and_replayed() -> None:
    with pytest.warns(RuntimeWarning, match="bypass torch's random ops"):
        never = _custom_grads([1, 1, 1], "never", "held")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        always = _custom_grads([1, 1, 1], "always", "held")
        other_layout = _custom_grads([2, 1], "except_last", "held")
        owned = _custom_grads([3], "always", "seeded")  # one worker owns the CPU generator
    assert all(torch.equal(a, b) for a, b in zip(never, always))
    assert_close(other_layout, never)
    assert_close(owned, never)


def test_random_ops_without_a_generator_argument_run_on_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(streams_module, "_HOLD_ABOVE", float("inf"))  # routed, not held
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # routed: nothing bypassed
        never = _custom_grads([1, 1, 1], "never", "routed", untagged=False)
        always = _custom_grads([2, 1], "always", "routed", untagged=False)
        owned = _custom_grads([3], "except_last", "seeded", untagged=False)
    assert_close(always, never)
    assert_close(owned, never)


def test_a_random_op_without_generator_argument_draws_as_on_the_seeded_default() -> None:
    x = torch.randn(64, dtype=torch.float64)
    before = torch.get_rng_state()
    with layer_stream(5, 0, 0):
        out, mask = torch.native_dropout(x, 0.3, True)  # takes no generator
        again = torch.nn.functional.dropout(x, 0.3)  # continues the same stream
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(stream_seed(5, 0, 0))
    expected, expected_mask = torch.native_dropout(x, 0.3, True)
    assert torch.equal(mask, expected_mask) and torch.equal(out, expected)
    assert torch.equal(again, torch.nn.functional.dropout(x, 0.3))


def test_stages_that_draw_overlap_in_time() -> None:
    """No lock: while one stage draws its masks, another stage draws its own."""
    model = nn.Sequential(*[nn.Sequential(SleepLayer(30, 10), nn.Dropout(0.1)) for _ in range(2)])
    pipe = GPipe(model, [1, 1], chunks=4, checkpoint="never")
    x = torch.randn(8, 4)
    for _ in range(2):  # learns which layers draw, and that routing them is cheaper
        pipe.train_step(x, torch.randn(8, 4), F.mse_loss)
    pipe.train_step(x, torch.randn(8, 4), F.mse_loss)
    forwards = [
        [(e.start, e.end) for e in device if e.action.kind == "F"]
        for device in pipe.timeline.events
    ]
    overlapping = [(a, b) for a in forwards[0] for b in forwards[1] if a[0] < b[1] and b[0] < a[1]]
    assert overlapping, f"stage forwards never overlapped: {forwards}"
    assert pipe._stages.streams.kind(0, True) == "routed"


def test_stream_seeds_are_stable_and_distinct_per_key_and_microbatch() -> None:
    assert stream_seed(123, 0, 0) == stream_seed(123, 0, 0)
    assert stream_seed(123, 0, 0) == 8333528867011618734  # every process, every version
    seeds = {
        stream_seed(123, key, mb) for key in [*range(8), "0", "a.b", LOSS_KEY] for mb in range(64)
    }
    assert len(seeds) == 11 * 64
    assert all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(TypeError, match="int position or a str name"):
        stream_seed(123, 1.5, 0)  # type: ignore[arg-type]


def test_a_layer_is_held_only_when_two_probes_see_it_bypass_routing() -> None:
    """Another stage drawing unrouted at the moment of a probe is not taken for this layer."""
    streams = Streams({0: torch.device("cpu"), 1: torch.device("cpu")})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        streams._learn(3, True, "held", stage=0, bypassed=True)
    assert streams.kind(3, True) is None  # probed again at its next forward
    streams._learn(3, True, "plain", stage=0)
    assert streams.kind(3, True) == "plain"
    with pytest.warns(RuntimeWarning, match="bypass torch's random ops"):
        streams._learn(4, True, "held", stage=0, bypassed=True)
        streams._learn(4, True, "held", stage=0, bypassed=True)
    assert streams.kind(4, True) == "held"


class _DrawsFromItsSecondCall(nn.Module):
    """Draws nothing at first, then dropout masks: its stage's forward is redone once."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.dropout(x, 0.5, self.training) if self.calls > 2 else x


@pytest.mark.parametrize("track_memory", [True, False])
def test_a_layer_that_begins_to_draw_mid_run_trains_with_memory_tracking_on_or_off(
    track_memory: bool,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _DrawsFromItsSecondCall(), nn.Linear(4, 4)).double()
    pipe = GPipe(
        model, [2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="never",
        track_memory=track_memory,
    )  # fmt: skip
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    losses = [float(pipe.train_step(x, y, F.mse_loss)) for _ in range(4)]
    assert all(loss == loss and loss > 0 for loss in losses)  # finite, no crash
    assert model[1].calls >= 8  # every micro-batch's forward ran (one redone)
