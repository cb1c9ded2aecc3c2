"""Generate the deepeyes_agentic dataset: shapes drawn with Pillow, one tiny number label, a question about it.

Usage: `python examples/deepeyes_agentic/make_data.py SEED OUTDIR [TRAIN_ROWS TEST_ROWS]` writes
`OUTDIR/images/{train,test}_NNN.png` and `OUTDIR/{train,test}.jsonl`. The committed copy under
`examples/deepeyes_agentic/data/` was made with `make_data.py 0 examples/deepeyes_agentic/data` and
`tests/unit/test_deepeyes_data.py` checks that regenerating it gives the same bytes.

Each image is a 224x224 canvas with three or four coloured shapes (circle, square, triangle), one in each
quadrant. One shape holds a two-digit number in Pillow's built-in 6x11 pixel bitmap font: small enough
that a vision model which sees the whole image at low resolution (`model=tiny_vl` sees 64x64) must crop
and zoom to read it. A row is `{"input": "<image>\\nWhat number is written inside the red circle? ...",
"images": ["images/train_000.png"], "metadata": {"answer": "42", "label_box": [x0, y0, x1, y1],
"shape_box": [...]}}`; image paths are relative to the JSONL's folder (the dataset resolves them).

Nothing is downloaded; the same SEED gives the same files (PNG written without metadata).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

SIZE = 224
CELL = SIZE // 2
COLOURS = {"red": (215, 40, 40), "green": (40, 160, 70), "blue": (50, 80, 215), "yellow": (225, 200, 40),
           "purple": (140, 60, 170), "orange": (235, 130, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTION = ("<image>\nWhat number is written inside the {colour} {shape}? The text is small: use the crop tool to "
            "look closer, then answer with just the number.")


@dataclass(frozen=True)
class Shape:
    """One drawn shape: kind, colour name and bounding box in pixels."""

    kind: str
    colour: str
    box: tuple[int, int, int, int]


def draw_shape(draw: ImageDraw.ImageDraw, shape: Shape) -> None:
    x0, y0, x1, y1 = shape.box
    fill = COLOURS[shape.colour]
    if shape.kind == "circle":
        draw.ellipse(shape.box, fill=fill)
    elif shape.kind == "square":
        draw.rectangle(shape.box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def place_shapes(rng: random.Random) -> list[Shape]:
    """Three or four shapes of distinct colours, one per quadrant, sizes 56-88 px."""
    cells = rng.sample(range(4), rng.choice((3, 4)))
    colours = rng.sample(sorted(COLOURS), len(cells))
    shapes = []
    for cell, colour in zip(cells, colours, strict=True):
        side = rng.randint(56, 88)
        x0 = (cell % 2) * CELL + rng.randint(4, CELL - side - 4)
        y0 = (cell // 2) * CELL + rng.randint(4, CELL - side - 4)
        shapes.append(Shape(rng.choice(SHAPES), colour, (x0, y0, x0 + side, y0 + side)))
    return shapes


def label_box(shape: Shape, text: str, font: ImageFont.ImageFont) -> tuple[int, int, int, int]:
    """Where the label goes: centred in the shape (in the lower half for a triangle, where it is wide)."""
    _, _, w, h = font.getbbox(text)
    x0, y0, x1, y1 = shape.box
    cy = (y0 + y1) // 2 + ((y1 - y0) // 5 if shape.kind == "triangle" else 0)
    left, top = (x0 + x1 - w) // 2, cy - h // 2
    return left, top, left + w, top + h


def make_row(rng: random.Random, path: Path, relative: str) -> dict:
    """Draw one image to `path`; the JSONL row that asks about it."""
    font = ImageFont.load_default_imagefont()
    shapes = place_shapes(rng)
    target = rng.choice(shapes)
    answer = str(rng.randint(10, 99))
    image = Image.new("RGB", (SIZE, SIZE), (250, 250, 245))
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        draw_shape(draw, shape)
    box = label_box(target, answer, font)
    draw.text(box[:2], answer, fill=(255, 255, 255) if target.colour != "yellow" else (0, 0, 0), font=font)
    image.save(path, format="PNG", optimize=True)
    return {"input": QUESTION.format(colour=target.colour, shape=target.kind), "images": [relative],
            "metadata": {"answer": answer, "label_box": list(box), "shape_box": list(target.box)}}


def write_split(rng: random.Random, out: Path, split: str, rows: int) -> Path:
    lines = []
    for i in range(rows):
        relative = f"images/{split}_{i:03d}.png"
        lines.append(json.dumps(make_row(rng, out / relative, relative), sort_keys=True))
    path = out / f"{split}.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_dataset(seed: int, out: Path, train_rows: int = 16, test_rows: int = 8) -> list[Path]:
    """Write both splits from one seeded generator; returns the JSONL paths."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    return [write_split(rng, out, "train", train_rows), write_split(rng, out, "test", test_rows)]


if __name__ == "__main__":
    if len(sys.argv) not in (3, 5):
        sys.exit("usage: make_data.py SEED OUTDIR [TRAIN_ROWS TEST_ROWS]")
    counts = [int(v) for v in sys.argv[3:5]]
    for written in write_dataset(int(sys.argv[1]), Path(sys.argv[2]), *counts):
        print(written)
