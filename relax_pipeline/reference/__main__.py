"""`python -m relax_pipeline.reference [--check]`: regenerate every reference page in docs/reference/.

With `--check` nothing is written: it exits 1 naming each page that differs from what the code generates (0
when none does). The pages and what each is generated from: `pages.PAGES`.
"""

from __future__ import annotations

import argparse
import sys

from relax_pipeline.reference import pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax_pipeline.reference", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a page is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = pages.stale()
        for name in stale:
            print(pages.difference(name), file=sys.stderr)
        print(f"{len(pages.PAGES) - len(stale)} of {len(pages.PAGES)} reference pages are up to date")
        return 1 if stale else 0
    for path in pages.write():
        print(f"wrote {path.relative_to(pages.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
