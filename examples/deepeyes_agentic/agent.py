"""`experiment=deepeyes_agentic`: a vision agent that zooms into its image with a `crop` tool before answering.

The agent contract (docs/design.md §3.2): the input's user message holds the question and the image as an OpenAI
`image_url` part (a data URI). Each turn replays the whole history through the OpenAI SDK with one function
tool, `crop` (`{"x0", "y0", "x1", "y1"}`: a box in pixels of the original image, or fractions of its size
when all four are in [0, 1]). The tool crops the box (clamped to the image) and enlarges it, and its result
goes back to the model AS AN IMAGE: a tool message whose content is a text part and an `image_url` part
(a PNG data URI), which the gateway records in the session forest and the rollout dump like the input
image. Bad arguments (not JSON, missing or non-numeric fields, an empty box) get a tool message saying what
to fix; the session goes on.

The session ends on a reply without a tool call (the answer) or after `DEEPEYES_MAX_TURNS` model calls
(default 4). The reward is exact match: the reply, stripped of spaces, an `answer:` prefix and trailing
punctuation, equals `metadata.answer`. An untrained model that never calls the tool, writes broken calls,
or runs past the context limit (a 400 from the gateway) ends with reward 0. Metadata: `crops` (crops
carried out), `crop_hit` (1 when some crop contained the label), `turns`. The conversation is exported
implicitly (the gateway's record of it).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from openai import BadRequestError, OpenAI
from PIL import Image

from relax_pipeline.data.media import load_image, png_data_uri

MAX_TURNS = int(os.environ.get("DEEPEYES_MAX_TURNS", "4"))
ZOOM_SIDE = 224
"""The enlarged crop's longer side in pixels (at most 8x the crop)."""
MIN_SIDE = 4
SYSTEM = ("You answer questions about an image. Small details are hard to see: call the crop tool with a box "
          "around the region to get an enlarged view, then answer with just the answer.")
TOOLS = [{"type": "function", "function": {
    "name": "crop",
    "description": "Crop a box of the original image and return it enlarged. Coordinates are pixels "
                   "(x to the right, y down), or fractions of the width and height when all are in [0, 1].",
    "parameters": {"type": "object", "properties": {k: {"type": "number"} for k in ("x0", "y0", "x1", "y1")},
                   "required": ["x0", "y0", "x1", "y1"]},
}}]
Box = tuple[int, int, int, int]


class ToolError(ValueError):
    """A crop call that cannot be carried out; the text goes back to the model."""


def parse_box(arguments: str, width: int, height: int) -> Box:
    """The pixel box of a crop call's JSON arguments, clamped to the image; `ToolError` says what is wrong."""
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        raise ToolError('arguments must be JSON: {"x0": 10, "y0": 20, "x1": 80, "y1": 90}') from None
    if isinstance(args, dict) and isinstance(args.get("bbox"), list) and len(args["bbox"]) == 4:
        args = dict(zip(("x0", "y0", "x1", "y1"), args["bbox"], strict=True))
    values = [args.get(k) for k in ("x0", "y0", "x1", "y1")] if isinstance(args, dict) else []
    if len(values) != 4 or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ToolError("give four numbers x0, y0, x1, y1 (pixels, or fractions in [0, 1])")
    if all(0 <= v <= 1 for v in values):
        values = [values[0] * width, values[1] * height, values[2] * width, values[3] * height]
    x0, x1 = sorted((_clamp(values[0], width), _clamp(values[2], width)))
    y0, y1 = sorted((_clamp(values[1], height), _clamp(values[3], height)))
    if x1 - x0 < MIN_SIDE or y1 - y0 < MIN_SIDE:
        raise ToolError(f"the box inside the {width}x{height} image is smaller than {MIN_SIDE} pixels a side")
    return x0, y0, x1, y1


def _clamp(value: float, limit: int) -> int:
    return max(0, min(limit, round(value)))


def crop(image: Image.Image, box: Box) -> Image.Image:
    """The box of `image`, enlarged so its longer side is `ZOOM_SIDE` (at most 8x)."""
    region = image.crop(box)
    scale = min(ZOOM_SIDE / max(region.size), 8.0)
    size = (max(1, round(region.width * scale)), max(1, round(region.height * scale)))
    return region.resize(size, Image.Resampling.BICUBIC)


def tool_message(call: dict[str, Any], image: Image.Image) -> tuple[dict[str, Any], Box | None]:
    """The tool message answering one call (an image, or an error text), and the box it cropped."""
    if call["function"]["name"] != "crop":
        return _tool_text(call, f"unknown tool {call['function']['name']!r}; the only tool is crop"), None
    try:
        box = parse_box(call["function"].get("arguments") or "", image.width, image.height)
    except ToolError as error:
        return _tool_text(call, f"error: {error}"), None
    content = [{"type": "text", "text": f"crop {list(box)} enlarged:"},
               {"type": "image_url", "image_url": {"url": png_data_uri(crop(image, box))}}]
    return {"role": "tool", "tool_call_id": call["id"], "content": content}, box


def _tool_text(call: dict[str, Any], text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call["id"], "content": text}


def first_image(messages: list[dict[str, Any]]) -> Image.Image:
    """The first `image_url` of the input messages, decoded."""
    for message in messages:
        for part in message.get("content") if isinstance(message.get("content"), list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                return load_image(part["image_url"]["url"])
    raise ValueError("the input has no image_url part; run with dataset.multimodal_keys.image=images")


def normalize(text: str) -> str:
    text = text.strip().lower()
    text = re.sub(r"^(the )?answer( is)?\s*:?\s*", "", text)
    return text.strip().rstrip(".!").strip()


def contains(outer: Box, inner: list[int]) -> bool:
    return outer[0] <= inner[0] and outer[1] <= inner[1] and outer[2] >= inner[2] and outer[3] >= inner[3]


def converse(client: OpenAI, messages: list[dict[str, Any]], image: Image.Image) -> tuple[str, list[Box], int]:
    """Run the turns, appending to `messages`: the final reply ("" when none), the crop boxes, model calls."""
    boxes: list[Box] = []
    for turn in range(1, MAX_TURNS + 1):
        try:
            response = client.chat.completions.create(model=os.environ.get("RELAX_MODEL", "policy"),
                                                      messages=messages, tools=TOOLS)
        except BadRequestError:  # context_length_exceeded and the like: the session ends unanswered
            return "", boxes, turn
        message = response.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            return message.get("content") or "", boxes, turn
        for call in calls:
            reply, box = tool_message(call, image)
            messages.append(reply)
            boxes += [box] if box else []
    return "", boxes, MAX_TURNS


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    client = OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"], max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, *task["messages"]]
    metadata = task.get("metadata") or {}
    answer, boxes, turns = converse(client, messages, first_image(task["messages"]))
    reward = float(bool(answer) and normalize(answer) == normalize(str(metadata.get("answer", ""))))
    label = metadata.get("label_box")
    hit = float(bool(label) and any(contains(b, label) for b in boxes))
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": reward, "metadata": {"crops": len(boxes), "crop_hit": hit, "turns": turns}}, f)


if __name__ == "__main__":
    main()
