"""Section 4: a pipelined step is plain training on the whole mini-batch, to round-off."""

from __future__ import annotations

import copy

import torch
from torch import nn

from gpipe.bench.markdown import Document
from gpipe.data import shakespeare
from gpipe.models import CharTokenizer, GPTConfig, gpt, gpt_loss, windows
from gpipe.pipe import GPipe
from gpipe.report.config import ReportSettings, SectionResult
from gpipe.report.figures import COLORS, new_figure, save

__all__ = ["TITLE", "run"]

TITLE = "Gradient accumulation = full batch"
COUNTS = (1, 2, 4, 8, 16)
BATCH = 16
STAGES = 4
TRAINING_STEPS = 100

INTRO = """\
GPipe's promise is that cutting a mini-batch into M micro-batches changes *when* the work
happens, never *what* is computed: each micro-batch's loss is weighted by its share of the
batch, the gradients of all micro-batches add up in the parameters, and the optimizer
steps once per mini-batch. So a pipelined step must give the gradients of plain training
on the whole batch, up to floating-point round-off. Here a small character-level GPT, in
float64, takes one step both ways for each M, and every parameter's gradient is compared;
then both train 100 steps (40 with --quick) from the same start on the same batches."""


def run(doc: Document, settings: ReportSettings) -> SectionResult:
    """Compare gradients for M in 1..16, then train both ways and overlay the losses."""
    text = shakespeare()
    chars = CharTokenizer.from_text(text)
    data = chars.encode(text)
    config = GPTConfig(vocab=chars.vocab, context=16, layers=2, heads=2, width=32, dropout=0.0)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = gpt(config).double()
    ids, targets = windows(data, BATCH, config.context, generator=generator)

    plain = copy.deepcopy(model)
    gpt_loss(plain(ids), targets).backward()
    expected = [_grad(p) for p in plain.parameters()]
    differences = []
    for m in COUNTS:
        piped = copy.deepcopy(model)
        pipe = GPipe(piped, devices=["cpu"] * STAGES, chunks=m)
        pipe.train_step(ids, targets, gpt_loss)
        got = [_grad(p) for p in piped.parameters()]
        worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
        scale = max(float(e.abs().max()) for e in expected)
        differences.append((m, worst, scale))

    steps = 40 if settings.quick else TRAINING_STEPS
    batches = [windows(data, BATCH, config.context, generator=generator) for _ in range(steps)]
    plain_losses = _train(copy.deepcopy(model), batches, pipe=False)
    pipe_losses = _train(copy.deepcopy(model), batches, pipe=True)
    loss_gap = max(abs(a - b) for a, b in zip(plain_losses, pipe_losses))

    figure, ax = new_figure(7.5, 3.8)
    xs = range(1, steps + 1)
    ax.plot(xs, plain_losses, color=COLORS[0], linewidth=3, alpha=0.5, label="plain, whole batch")
    ax.plot(xs, pipe_losses, "--", color=COLORS[2], linewidth=1.2, label="pipe, K=4, M=8")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per character)")
    ax.set_title(f"the two curves, float64: largest gap {loss_gap:.1e}", loc="left")
    ax.grid(alpha=0.3)
    ax.legend()
    picture = save(figure, settings.out, "accumulation.png")

    doc.heading(f"4. {TITLE}")
    doc.paragraph(INTRO)
    doc.table(
        ["M", "largest gradient difference", "largest gradient"],
        [[m, f"{worst:.1e}", f"{scale:.2e}"] for m, worst, scale in differences],
    )
    doc.image(picture, "loss curves, plain and pipelined")
    largest = max(worst for _, worst, _ in differences)
    doc.paragraph(
        f"Every gradient agrees to {largest:.1e} (float64 round-off is about 1e-16 of the "
        f"values' size, here up to {differences[0][2]:.2f}), whatever M; the loss curves "
        f"over {steps} AdamW steps differ by at most {loss_gap:.1e}. The test suite checks "
        "the same for every schedule and checkpoint mode."
    )
    return SectionResult(
        4,
        TITLE,
        f"largest gradient difference over M in {COUNTS}: {largest:.1e}; "
        f"loss curves over {steps} steps differ by {loss_gap:.1e}",
        [picture],
        {"grad_max_diff": f"{largest:.2e}", "loss_max_diff": f"{loss_gap:.2e}"},
    )


def _train(
    model: nn.Sequential, batches: list[tuple[torch.Tensor, torch.Tensor]], *, pipe: bool
) -> list[float]:
    """Train on ``batches`` with AdamW, plainly or as a K=4, M=8 pipe; the loss per step."""
    runner: nn.Module = GPipe(model, devices=["cpu"] * STAGES, chunks=8) if pipe else model
    optimizer = torch.optim.AdamW(runner.parameters(), lr=3e-3)
    losses = []
    for ids, targets in batches:
        if isinstance(runner, GPipe):
            loss = runner.train_step(ids, targets, gpt_loss)
        else:
            loss = gpt_loss(runner(ids), targets)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _grad(parameter: nn.Parameter) -> torch.Tensor:
    assert parameter.grad is not None, "every parameter of the GPT takes a gradient"
    return parameter.grad
