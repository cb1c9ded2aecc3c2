"""Chunked chosen-token logprobs (train/token_logprobs.py): the whole-tensor form's values and gradients, and a
working set of one chunk, never a [rows, V] float32 tensor."""

from __future__ import annotations

import pytest
import torch

from relax_pipeline.train import token_logprobs as module
from relax_pipeline.train.token_logprobs import token_logprobs


def whole(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, temperature: float,
          entropy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The form it replaces: one log-softmax over every row, gathered."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp[rows, targets], -(logp.exp() * logp).sum(-1)[rows]


def run(form, dtype: torch.dtype, entropy: str) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(37, 300, generator=generator) * 3
    rows = torch.randint(0, 37, (5, 9), generator=generator)
    targets = torch.randint(0, 300, (5, 9), generator=generator)
    weights = torch.randn(2, 5, 9, generator=generator)
    logits = base.to(dtype).requires_grad_()
    chosen, entropies = form(logits, rows, targets, 0.7, entropy)
    loss = (chosen * weights[0]).sum() + (entropies * weights[1]).sum() * (entropy == "train")
    loss.backward()
    return chosen.detach(), entropies.detach(), logits.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", ["metric", "train"])
def test_the_whole_tensor_values_and_gradients(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                               entropy: str) -> None:
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 4 * 300)  # 4 rows a chunk: several chunks, a short last one
    ours, theirs = run(token_logprobs, dtype, entropy), run(whole, dtype, entropy)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-6, atol=1e-7)


def test_no_entropy_and_greedy_temperature() -> None:
    logits = torch.randn(6, 50)
    chosen, entropy = token_logprobs(logits, torch.tensor([[0, 5]]), torch.tensor([[3, 7]]), 0.0)
    expected = torch.log_softmax(logits, -1)[[0, 5], [3, 7]]
    assert entropy is None and torch.equal(chosen, expected.unsqueeze(0))


def test_float32_working_tensors_are_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    rows, vocab = 64, 1000
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 8 * vocab)
    seen: list[int] = []
    original = torch.log_softmax

    def recorded(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(tensor.shape[0])
        return original(tensor, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "log_softmax", recorded)
    logits = torch.randn(rows, vocab, requires_grad=True)
    chosen, _ = token_logprobs(logits, torch.arange(rows).view(8, 8), torch.zeros(8, 8, dtype=torch.long), 1.0, "train")
    chosen.sum().backward()
    assert seen and max(seen) == 8, "forward and backward each see chunks of 8 rows, never all 64"
    assert len(seen) == 2 * rows // 8
