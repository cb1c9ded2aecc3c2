"""`engine=sglang` images and tensor weight transfer, through the SGLang-wire fake.

- Images: a prompt with image placeholders goes as `image_data` (the images' URLs) with its unexpanded ids; the
  fake processes them with its embedded engine's own vision, and the tokens are those a separate embedded engine
  gives for that prompt and those images. Such a turn is never a session turn.
- `engine.weight_transfer=tensor`: `/update_weights_from_tensor` in buckets, the version set by the last one; new
  weights change the output, versions are carried; `distributed` over NCCL is refused at start on the CPU, naming
  the key (over gloo it runs: `test_sglang_distributed.py`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from PIL import Image as PILImage

from relax_pipeline.canonical.form import image_of
from relax_pipeline.data.media import png_data_uri
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings, SglangEngineSettings
from relax_pipeline.engine.sglang.client import SglangEngine
from relax_pipeline.engine.sglang.media import SglangVision
from relax_pipeline.engine.sglang.weights import tensor_bodies
from relax_pipeline.engine.vision import Vision
from tests.integration.test_sglang_engine import GREEDY, _moved_weights, client, fakes

pytestmark = pytest.mark.integration


def _image(color: tuple[int, int, int], i: int) -> object:
    return image_of(png_data_uri(PILImage.new("RGB", (56, 56), color)), 0, f"messages[{i}]")


def test_images_go_as_image_data_and_generate_what_the_embedded_engine_does(tiny_vl_path: Path,
                                                                            tmp_path: Path) -> None:
    async def go() -> None:
        direct = HFEngine(HFEngineSettings(), EngineRun(str(tiny_vl_path), seed=0))
        await direct.start()
        try:
            async with fakes(tiny_vl_path) as [server], client(tiny_vl_path, [server], tmp_path) as engine:
                assert engine.vision is not None
                pad = engine.vision.image_token_id
                media = [engine.vision.features(_image((200, 30, 30), 0)),  # type: ignore[arg-type]
                         engine.vision.features(_image((20, 30, 220), 1))]  # type: ignore[arg-type]
                prompt = [5, 6, pad, 7, 8, pad, 9, 10]
                got = await engine.generate(prompt, GREEDY, "img", media=media, session_id="s")
                want = await direct.generate(prompt, GREEDY, "img", media=media)
                assert got.output_ids == want.output_ids and got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
                stats = server.state.stats()
                assert "POST /generate image_data" in stats["sent"]
                assert stats["sessions_open"] == [], "a turn with images is a plain request, not a session turn"
                with pytest.raises(ValueError, match="2 image placeholder tokens .* for 1 images"):
                    await engine.generate(prompt, GREEDY, "bad", media=media[:1])
        finally:
            await direct.close()

    asyncio.run(go())


def test_a_text_model_refuses_images(tiny_path: Path, tiny_vl_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path) as [server], client(tiny_path, [server], tmp_path) as engine:
            assert engine.vision is None
            vision = Vision.load(tiny_vl_path)
            assert vision is not None
            features = vision.features(_image((1, 2, 3), 0))  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="text-only"):
                await engine.generate([5, 6, 7], GREEDY, "t", media=[features])

    asyncio.run(go())


def test_tensor_transfer_loads_new_weights_in_buckets_with_the_version(tiny_path: Path, tmp_path: Path) -> None:
    async def go() -> None:
        async with fakes(tiny_path, 2) as servers, \
                client(tiny_path, servers, tmp_path, weight_transfer="tensor") as engine:
            prompt = list(range(3, 30))
            before = await engine.generate(prompt, GREEDY, "b")
            await engine.update_weights(_moved_weights(tiny_path), 1)
            after = await engine.generate(prompt, GREEDY, "a")
            assert after.weight_version == 1 and engine.weight_version == 1
            assert after.logprobs[0] != pytest.approx(before.logprobs[0], abs=1e-4), "new weights serve"
            direct = await servers[0].engine.generate(prompt, GREEDY, "d")
            assert direct.output_ids == after.output_ids
            assert [s.state.weight_version for s in servers] == ["1", "1"]
            assert [s.state.calls["POST /update_weights_from_tensor"] for s in servers] == [1, 1]
            assert not (tmp_path / "sglang" / "weights").exists(), "nothing is written to disk"

    asyncio.run(go())


def test_tensor_bodies_set_the_version_and_flush_on_the_last_bucket_only(tiny_path: Path) -> None:
    state = _moved_weights(tiny_path)

    async def go() -> list[dict]:
        return [body async for body in tensor_bodies(state, 2, 3, True, bucket_bytes=1)]

    bodies = asyncio.run(go())
    assert len(bodies) == len(state), "a tensor larger than a bucket goes alone"
    assert all(len(b["serialized_named_tensors"]) == 2 for b in bodies), "one entry per TP rank"
    assert [b.get("weight_version") for b in bodies] == [None] * (len(bodies) - 1) + ["3"]
    assert [b["flush_cache"] for b in bodies] == [False] * (len(bodies) - 1) + [True]


def test_distributed_transfer_over_nccl_is_refused_at_start_on_the_cpu(tiny_path: Path, tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may broadcast over NCCL")

    async def go() -> None:
        async with fakes(tiny_path) as [server]:
            settings = SglangEngineSettings(urls=[server.url], weight_transfer="distributed", weight_backend="nccl")
            engine = SglangEngine(settings, EngineRun(str(tiny_path), output_dir=str(tmp_path)))
            with pytest.raises(ValueError, match="engine.weight_backend=nccl .* needs CUDA"):
                await engine.start()

    asyncio.run(go())
    with pytest.raises(ValueError, match="engine.weight_transfer"):
        SglangEngineSettings(urls=["http://x"], weight_transfer="nfs")


def test_image_urls_live_as_long_as_their_features_and_a_retokenized_prompt_is_counted(tiny_vl_path: Path) -> None:
    import gc

    vision = SglangVision.load(tiny_vl_path)
    assert vision is not None
    vision.vision._cache_size = 0  # the processor's own cache keeps nothing alive here
    image = _image((5, 50, 150), 0)
    features = vision.features(image)  # type: ignore[arg-type]
    pad = vision.image_token_id
    assert vision.image_data([1, pad, 2], [features]) == [image.url]  # type: ignore[attr-defined]
    del features
    gc.collect()
    assert vision._urls == {}, "the URL goes with the last features of its image"
    vision.served({"prompt_tokens": 10}, 10, "u")
    vision.served({"prompt_tokens": 11}, 10, "u")
    assert vision.mismatches == 1
