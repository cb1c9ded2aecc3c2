"""The embedded engine's decode fast path: wide KV views for `grouped` attention and sampling's reused buffers.

`SpareLayer(wide=True)` hands a decode step its keys/values at the whole buffer's width (unused columns zero) so the
attention's batched matmuls read them in place; `grouped_attention` masks the columns past its mask. These tests
check that the shortcut changes nothing: the layer's own view, the attention output, and whole generations on the
real tiny model (batched equals alone through rows leaving and joining, greedy and seeded). `sampling.Workspace`
reuses buffers across steps of different row counts without changing a token or logprob.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_pipeline.engine.base import SamplingParams
from relax_pipeline.engine.hf.batch import SpareLayer
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.sampling import Workspace, make_generator, sample_rows
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings
from relax_pipeline.models.attention import grouped_attention


def test_a_wide_layer_returns_its_whole_buffer_and_keeps_the_narrow_view() -> None:
    generator = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(2, 3, 5, 4, generator=generator) for _ in range(2))
    layer = SpareLayer(wide=True)
    layer.update(keys, values)
    step = [torch.randn(2, 3, 1, 4, generator=generator) for _ in range(2)]
    wide_keys, wide_values = layer.update(*step)
    assert wide_keys.is_contiguous() and wide_values.is_contiguous() and wide_keys.shape[2] > 6
    assert torch.equal(layer.keys, torch.cat([keys, step[0]], dim=2)) and torch.equal(wide_keys[:, :, :6], layer.keys)
    assert torch.equal(wide_values[:, :, :6], layer.values) and not wide_values[:, :, 6:].any()
    assert layer.update(torch.zeros(2, 3, 2, 4), torch.zeros(2, 3, 2, 4))[0].shape[2] == 8  # prefills stay narrow


def test_grouped_attention_masks_keys_wider_than_its_mask() -> None:
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 4, 1, 8, generator=generator)
    keys, values = (torch.randn(2, 2, 6, 8, generator=generator) for _ in range(2))
    mask = torch.zeros(2, 1, 1, 6)
    mask[0, ..., 0] = torch.finfo(torch.float32).min  # row 0's first column is padding
    wide_keys, wide_values = (torch.cat([t, torch.randn(2, 2, 3, 8, generator=generator)], dim=2)
                              for t in (keys, values))
    module = torch.nn.Module()
    narrow, _ = grouped_attention(module, query, keys, values, mask, 0.125)
    wide, _ = grouped_attention(module, query, wide_keys, wide_values, mask, 0.125)
    assert torch.allclose(wide, narrow, atol=1e-6)


def test_a_workspace_changes_no_token_or_logprob() -> None:
    generator = torch.Generator().manual_seed(2)
    params = [SamplingParams(max_new_tokens=1, temperature=t) for t in (0.7, 0.0, 1.0, 0.7, 1.0)]
    space = Workspace()
    for rows in (5, 3, 5, 2):  # steps of different sizes share the buffers
        logits = (torch.randn(rows, 300, generator=generator) * 3).bfloat16()
        seeds = [make_generator(10 + i, "cpu") for i in range(rows)]
        fresh = sample_rows(logits, params[:rows], [make_generator(10 + i, "cpu") for i in range(rows)])
        assert sample_rows(logits, params[:rows], seeds, space) == fresh


@pytest.fixture(scope="module")
def model_path(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with sharper weights (as in test_hf_engine.py): varied greedy outputs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    target = tmp_path_factory.mktemp("tiny-sharp-wide")
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(target)
    return target


@pytest_asyncio.fixture
async def grouped(model_path: Path) -> AsyncIterator[HFEngine]:
    eng = HFEngine(HFEngineSettings(attn_implementation="grouped"), EngineRun(str(model_path), seed=7))
    await eng.start()
    yield eng
    await eng.close()


def prompt(length: int, offset: int = 0) -> list[int]:
    return [9 + (31 * i + 17 * offset) % 500 for i in range(length)]


@pytest.mark.asyncio
@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_wide_decode_batched_equals_alone_through_rows_leaving_and_joining(grouped: HFEngine,
                                                                                 temperature: float) -> None:
    """Rows leave at different steps and later requests join into their places, across buffer regrowths (more
    decode steps than the spare columns): every request decodes what it decodes alone."""
    first = [(prompt(5 + 7 * i, i), SamplingParams(max_new_tokens=n, temperature=temperature, seed=i))
             for i, n in enumerate([3, 60, 1, 25, 60])]
    later = [(prompt(6 + i, 20 + i), SamplingParams(max_new_tokens=30, temperature=temperature, seed=9 + i))
             for i in range(2)]
    alone = [await grouped.generate(p, s, rid=f"solo{i}") for i, (p, s) in enumerate(first + later)]
    running = [asyncio.create_task(grouped.generate(p, s, rid=f"r{i}")) for i, (p, s) in enumerate(first)]
    while grouped.stats["tokens"] < sum(len(r.output_ids) for r in alone) + 20:
        await asyncio.sleep(0.001)
    joined = await asyncio.gather(*(grouped.generate(p, s, rid=f"j{i}") for i, (p, s) in enumerate(later)))
    together = [*(await asyncio.gather(*running)), *joined]
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    for a, b in zip(alone, together, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
