"""What a terminal shows for the text a program wrote to it: the stand-in for the terminal a person watches a run in.

It follows a VT100's two controls that progress bars use (tqdm's `status_printer` and `clear` write only these): a
carriage return moves the cursor to the start of the line, and a line feed starts the next line; any other character
is written at the cursor, overwriting what was there. Escape sequences (cursor up, colours) are not interpreted:
the run's console uses one bar at a time, at position 0, which writes none.
"""

from __future__ import annotations

import re


def screen(text: str) -> list[str]:
    """The lines a terminal shows for `text`, trailing blanks removed, empty lines left out."""
    lines = []
    for raw in text.split("\n"):
        row: list[str] = []
        col = 0
        for piece in re.split(r"(\r)", raw):
            if piece == "\r":
                col = 0
                continue
            for char in piece:
                row[col:col + 1] = [char]
                col += 1
        lines.append("".join(row).rstrip())
    return [line for line in lines if line]
