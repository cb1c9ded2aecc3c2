"""Write a small image dataset for `model=tiny_vl`: coloured PNGs drawn with PIL and a JSONL of prompts.

Usage: `python examples/multimodal/make_dataset.py OUT_DIR [ROWS]` writes `OUT_DIR/images/*.png` and
`OUT_DIR/data.jsonl`. Each row asks about two images (two `<image>` placeholders, relative paths under
`images`) and names the colours in `metadata.answer`. Run it with
`dataset.path=OUT_DIR/data.jsonl +dataset.multimodal_keys.image=images`. Nothing is downloaded.
"""

import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def draw(path: Path, colour: tuple[int, int, int], size: tuple[int, int]) -> None:
    image = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(image).ellipse([2, 2, size[0] - 3, size[1] - 3], fill=colour)
    image.save(path)


def write_dataset(out: Path, rows: int = 2) -> Path:
    """Write `rows` prompts with two images each; returns the JSONL path."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    lines = []
    for i in range(rows):
        first, second = names[i % len(names)], names[(i + 1) % len(names)]
        draw(out / "images" / f"{i}a.png", COLOURS[first], (32 + 8 * i, 24))
        draw(out / "images" / f"{i}b.png", COLOURS[second], (40, 40))
        row = {"input": "Which colours are these? <image> and <image>",
               "images": [f"images/{i}a.png", f"images/{i}b.png"], "metadata": {"answer": f"{first} {second}"}}
        lines.append(json.dumps(row))
    path = out / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


if __name__ == "__main__":
    print(write_dataset(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2))
