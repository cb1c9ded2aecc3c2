"""Multimodal input: dataset images to data URIs, image parts in all three APIs, the VL engine, text-only 400s.

Gateway tests run the real app under uvicorn with the real `openai` and `anthropic` SDKs; the engine is
`ScriptedEngine` given the tiny VL model's `Vision`, so the turn service processes real images and the
forest records them while the answers stay known. The embedded engine test runs the real tiny VL model
and checks its logprobs against a teacher-forced forward with the same pixels (mrope positions
included). End to end through an agent: `test_multimodal_e2e.py`.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import torch
from PIL import Image as PILImage
from test_gateway import assert_openai_error, running_gateway

from relax_pipeline.agent.session_io import build_input
from relax_pipeline.canonical.form import Context, chain_all, parse_messages
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.data.dataset import JsonlDataset
from relax_pipeline.data.media import MediaError, image_url, load_image, png_data_uri
from relax_pipeline.data.settings import JsonlSettings
from relax_pipeline.engine.base import SamplingParams, expand_placeholders
from relax_pipeline.engine.hf.engine import HFEngine
from relax_pipeline.engine.settings import EngineRun, HFEngineSettings
from relax_pipeline.engine.vision import Vision
from relax_pipeline.protocol.chat import ChatFrontend
from relax_pipeline.protocol.messages import MessagesFrontend, parse_conversation
from relax_pipeline.protocol.responses import ResponsesFrontend
from relax_pipeline.testing.engines import ScriptedEngine
from relax_pipeline.turn.service import SamplingDefaults
from relax_pipeline.turn.sessions import Session

pytestmark = [pytest.mark.timeout(60)]


def png(colour: tuple[int, int, int], size: tuple[int, int] = (32, 24), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    PILImage.new(mode, size, colour if mode == "RGB" else (*colour, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


RED, BLUE = png((200, 20, 20)), png((20, 20, 200), (40, 40))
RED_URI = "data:image/png;base64," + base64.b64encode(RED).decode()
BLUE_URI = "data:image/png;base64," + base64.b64encode(BLUE).decode()


def chat_image(uri: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": uri}}


# --- dataset and agent input ------------------------------------------------------------------------


def test_sources_become_rgb_png_data_uris(tmp_path: Path) -> None:
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(png((1, 2, 3), mode="RGBA"))
    pil = PILImage.new("P", (8, 8))
    uris = [image_url("pics/a.png", tmp_path), image_url(RED), image_url(pil),
            image_url({"bytes": base64.b64encode(BLUE).decode()}), image_url({"path": str(tmp_path / "pics/a.png")})]
    for uri in uris:
        assert uri.startswith("data:image/png;base64,")
        image = load_image(uri)
        assert image.mode == "RGB" and PILImage.open(io.BytesIO(base64.b64decode(uri.split(",")[1]))).mode == "RGB"
    assert load_image(uris[0]).size == (32, 24) and load_image(uris[3]).size == (40, 40)
    for url in ("data:image/jpeg;base64,AAAA", "http://example.com/a.png", "https://example.com/b.png"):
        assert image_url(url) == url
    with pytest.raises(MediaError, match="does not exist"):
        image_url("missing.png", tmp_path)
    with pytest.raises(MediaError, match="not a readable image"):
        image_url(b"not an image")


def test_build_input_puts_image_parts_at_the_placeholders() -> None:
    payload = build_input("Compare <image> with <image>.", {"k": 1}, [RED, "https://example.com/x.png"])
    content = payload["messages"][0]["content"]
    assert [p["type"] for p in content] == ["text", "image_url", "text", "image_url", "text"]
    assert content[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert content[3]["image_url"]["url"] == "https://example.com/x.png" and payload["metadata"] == {"k": 1}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image> what?"}]
    built = build_input(messages, None, [RED])["messages"]
    assert built[0] == messages[0] and built[1]["content"][0]["type"] == "image_url"
    assert messages[1]["content"] == "<image> what?", "the row is not modified"


def test_dataset_placeholder_mismatch_names_the_row(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(RED)
    rows = [{"input": "one <image>", "images": ["a.png"]}, {"input": "two <image> <image>", "images": ["a.png"]}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"data.jsonl:2: the prompt has 2 <image> placeholder\(s\) but 'images'"):
        JsonlDataset(JsonlSettings(str(path), multimodal_keys={"image": "images"}))
    path.write_text(json.dumps({"input": "<image>", "images": ["gone.png"]}))
    with pytest.raises(ValueError, match=r"data.jsonl:1: images\[0\]: image file .* does not exist"):
        JsonlDataset(JsonlSettings(str(path), multimodal_keys={"image": "images"}))
    with pytest.raises(ValueError, match="unsupported media kind.*'video'"):
        JsonlDataset(JsonlSettings(str(path), multimodal_keys={"video": "clips"}))
    path.write_text(json.dumps(rows[0]))
    prompt = JsonlDataset(JsonlSettings(str(path), multimodal_keys={"image": "images"})).prompts[0]
    assert prompt.images == (str(tmp_path / "a.png"),)


def test_image_identity_and_position_are_hashed() -> None:
    def hashes(content: Any) -> bytes:
        return chain_all(Context(), parse_messages([{"role": "user", "content": content}]))[-1]

    red_then_text = hashes([chat_image(RED_URI), {"type": "text", "text": "what?"}])
    assert red_then_text == hashes([chat_image(RED_URI), {"type": "text", "text": "what?"}])
    assert red_then_text != hashes([chat_image(BLUE_URI), {"type": "text", "text": "what?"}])
    assert red_then_text != hashes([{"type": "text", "text": "what?"}, chat_image(RED_URI)])
    assert red_then_text != hashes("what?")
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(RED).decode()}}
    messages, _, context = parse_conversation({"messages": [{"role": "user", "content": [
        block, {"type": "text", "text": "what?"}]}]})
    assert chain_all(context, messages)[-1] == red_then_text, "Messages and Chat hash one image alike"


# --- gateway: a vision-language model through all three APIs ----------------------------------------


@pytest.fixture(scope="module")
def vl_template(tiny_vl_path: Path) -> ChatTemplate:
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(tiny_vl_path))


@pytest.fixture(scope="module")
def vision(tiny_vl_path: Path) -> Vision:
    loaded = Vision.load(tiny_vl_path)
    assert loaded is not None
    return loaded


ALL = [ChatFrontend(), ResponsesFrontend(), MessagesFrontend()]


def check_observation(session: Session, node_id: int, images: int, vision: Vision) -> None:
    node = session.forest.nodes[node_id]
    assert node.kind == "observation" and len(node.media) == images
    assert node.token_ids.count(vision.image_token_id) == images
    expanded = node.train_ids or node.token_ids
    assert expanded.count(vision.image_token_id) == sum(m.tokens for m in node.media)


@pytest.mark.asyncio
async def test_openai_chat_sdk_sends_images_in_user_and_tool_messages(vl_template: ChatTemplate,
                                                                      vision: Vision) -> None:
    engine = ScriptedEngine(vl_template.tokenizer, ["A red box.", "Blue."], vision=vision)
    async with running_gateway(vl_template, engine, frontends=ALL) as gw:
        session = gw.open_session()
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0,
                                    _strict_response_validation=True)
        messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                             chat_image(RED_URI)]}]
        first = await client.chat.completions.create(model="m", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": [chat_image(BLUE_URI), {"type": "text", "text": "And this?"}]}]
        async with client.chat.completions.stream(model="m", messages=messages) as stream:
            second = await stream.get_final_completion()
    assert second.choices[0].message.content == "Blue."
    check_observation(session, 1, 1, vision)
    check_observation(session, 3, 1, vision)
    assert [len(m) for m in engine.media] == [1, 2], "the engine gets every image of the lineage"
    assert engine.prompts[1].count(vision.image_token_id) == 2, "inference ids keep one placeholder per image"
    assert session.forest.nodes[1].media[0].digest != session.forest.nodes[3].media[0].digest


@pytest.mark.asyncio
async def test_openai_responses_sdk_sends_input_image(vl_template: ChatTemplate, vision: Vision) -> None:
    engine = ScriptedEngine(vl_template.tokenizer, ["Red.", "Blue."], vision=vision)
    async with running_gateway(vl_template, engine, frontends=ALL) as gw:
        session = gw.open_session()
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0,
                                    _strict_response_validation=True)
        user = {"role": "user", "content": [{"type": "input_text", "text": "Colour?"},
                                            {"type": "input_image", "image_url": RED_URI, "detail": "auto"}]}
        reply = await client.responses.create(model="m", input=[user])
        history = [user, {"role": "assistant", "content": reply.output_text},
                   {"role": "user", "content": [{"type": "input_image", "image_url": BLUE_URI, "detail": "low"}]}]
        stream = await client.responses.create(model="m", input=history, stream=True)
        events = [event async for event in stream]
    assert reply.output_text == "Red." and events[-1].type == "response.completed"
    assert [n.kind for n in session.forest.nodes] == ["root", "observation", "response", "observation", "response"]
    check_observation(session, 1, 1, vision)
    check_observation(session, 3, 1, vision)


@pytest.mark.asyncio
async def test_anthropic_sdk_sends_image_blocks_in_user_and_tool_results(vl_template: ChatTemplate,
                                                                         vision: Vision) -> None:
    call = '<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>'
    engine = ScriptedEngine(vl_template.tokenizer, [call, "Both are boxes."], vision=vision)
    red = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                       "data": base64.b64encode(RED).decode()}}
    blue = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(BLUE).decode()}}
    tools = [{"name": "look", "description": "Take a picture.", "input_schema": {"type": "object"}}]
    async with running_gateway(vl_template, engine, frontends=ALL) as gw:
        session = gw.open_session()
        client = anthropic.AsyncAnthropic(base_url=gw.base_url.rstrip("/"), api_key=session.key, max_retries=0,
                                          _strict_response_validation=True)
        messages: list[Any] = [{"role": "user", "content": [red, {"type": "text", "text": "Look again."}]}]
        first = await client.messages.create(model="m", max_tokens=64, messages=messages, tools=tools)
        use = next(b for b in first.content if b.type == "tool_use")
        messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": [{"type": "text", "text": "photo:"}, blue]}]}]
        async with client.messages.stream(model="m", max_tokens=64, messages=messages, tools=tools) as stream:
            final = await stream.get_final_message()
    assert first.stop_reason == "tool_use" and final.content[0].text == "Both are boxes."
    check_observation(session, 1, 1, vision)
    check_observation(session, 3, 1, vision)
    tool = session.forest.nodes[3].messages[0]
    assert tool.role == "tool" and tool.content == "photo:" and tool.images[0].offset == len("photo:")


@pytest.mark.asyncio
async def test_context_limit_counts_expanded_image_tokens(vl_template: ChatTemplate, vision: Vision) -> None:
    body = {"messages": [{"role": "user", "content": [chat_image(BLUE_URI), {"type": "text", "text": "hi"}]}]}
    prompt_ids = vl_template.prompt_ids(parse_messages(body["messages"]), Context())
    engine = ScriptedEngine(vl_template.tokenizer, ["x"], vision=vision)
    defaults = SamplingDefaults(max_context_len=len(prompt_ids) + 10)
    async with running_gateway(vl_template, engine, defaults=defaults, frontends=ALL) as gw:
        reply = await gw.post(gw.open_session(), body)
    error = assert_openai_error(reply, 400, "invalid_request_error")
    assert error["code"] == "context_length_exceeded" and f"{len(prompt_ids) + 24} tokens >" in error["message"]


# --- a text-only model refuses images with a 400 in each protocol's shape ---------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("stream", [False, True])
async def test_text_only_model_answers_images_with_400(template: ChatTemplate, tokenizer: Any,
                                                       stream: bool) -> None:
    engine = ScriptedEngine(tokenizer, ["never"])
    chat = {"stream": stream, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"},
                                           {"role": "user", "content": [{"type": "text", "text": "x"},
                                                                        chat_image(RED_URI)]}]}
    responses = {"stream": stream, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]}
    messages = {"stream": stream, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}
    async with running_gateway(template, engine, frontends=ALL) as gw:
        session = gw.open_session()
        answers = [await gw.post(session, chat), await gw.post(session, responses, "v1/responses"),
                   await gw.post(session, messages, "v1/messages", headers={"x-api-key": session.key})]
        with pytest.raises(openai.BadRequestError, match="text-only"):
            await gw.sdk(session).chat.completions.create(model="m", messages=chat["messages"])
    for reply, param in zip(answers[:2], ("messages[2].content[1]", "input[0].content[0]"), strict=True):
        error = assert_openai_error(reply, 400, "invalid_request_error")
        assert error["param"] == param and "text-only" in error["message"]
    assert answers[2].status_code == 400
    assert answers[2].json()["error"]["message"].startswith("messages[0].content[0]: this model is text-only")
    assert engine.prompts == [] and session.forest.nodes == []


# --- the embedded engine on the tiny VL model ---------------------------------------------------------


@pytest.mark.asyncio
async def test_hf_engine_vl_logprobs_match_a_teacher_forced_forward(tiny_vl_path: Path, vision: Vision,
                                                                    vl_template: ChatTemplate) -> None:
    engine = HFEngine(HFEngineSettings(max_batch_size=4), EngineRun(str(tiny_vl_path), seed=3))
    await engine.start()
    try:
        assert engine.vision is not None and engine.vision.image_token_id == vision.image_token_id
        messages = parse_messages([{"role": "user", "content": [
            {"type": "text", "text": "look "}, chat_image(RED_URI), {"type": "text", "text": " and "},
            chat_image(png_data_uri(PILImage.new("RGB", (40, 40), (0, 0, 255))))]}])
        ids = vl_template.prompt_ids(messages, Context())
        media = [engine.vision.features(image) for image in messages[0].images]
        sampling = SamplingParams(10, temperature=1.0, seed=11)
        text = vl_template.encode("hello there")
        with_images, text_only = await _together(engine, ids, media, text, sampling)
        logprobs = _teacher_forced(engine.model, expand_placeholders(ids, vision.image_token_id, media), media,
                                   with_images.output_ids)
        assert torch.allclose(logprobs, torch.tensor(with_images.logprobs), atol=1e-4)
        alone = await engine.generate(text, sampling, "alone")
        assert alone.output_ids == text_only.output_ids, "text rows decode as before next to image rows"
        with pytest.raises(ValueError, match="placeholder"):
            await engine.generate(ids, sampling, "missing", media=media[:1])
    finally:
        await engine.close()


async def _together(engine: HFEngine, ids: list[int], media: list[Any], text: list[int],
                    sampling: SamplingParams) -> tuple[Any, Any]:
    import asyncio

    return await asyncio.gather(engine.generate(ids, sampling, "img", media=media),
                                engine.generate(text, sampling, "txt"))


def _teacher_forced(model: Any, prompt: list[int], media: list[Any], output: tuple[int, ...]) -> torch.Tensor:
    ids = torch.tensor([prompt + list(output)])
    grid = torch.tensor([list(m.grid_thw) for m in media])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), image_grid_thw=grid,
                    pixel_values=torch.cat([m.pixel_values for m in media]),
                    mm_token_type_ids=(ids == model.config.image_token_id).int())
    logp = torch.log_softmax(out.logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    return logp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
