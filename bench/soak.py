"""Load soak: waves of 64 concurrent sessions × 32 turns through the real gateway for N minutes; gateway RSS.

The gateway runs in its own process exactly as `bench/gateway.py` starts it (`_gateway_server.start_ours`:
`create_app` under `GatewayServer.start()`, the scripted engine answering at once, run.log access lines on); this
process only drives it. Each wave opens `--sessions` sessions (default 64), runs them at once, one keep-alive
connection each, `--turns` turns apiece (default 32), every turn replaying the whole growing history, then
ends them as a run ends a finished group's sessions (`ForestStore.set_status(COMPLETED)` then
`ForestStore.release`; `--keep-ended` skips the release, as runs did before: every forest stays and the
RSS grows with every wave). Waves repeat until `--minutes` (default 10) have passed.

Printed: the gateway's RSS (after a full collection) at the start (after the first wave: warm-up), in the
middle and at the end, with the sessions the store still holds and their stored tokens; requests, errors
(any answer but 200 counts) and requests/s. Exit status 1 on any error or when the RSS grew more than
`--max-growth-mib` (default 64) from start to end.

    python bench/soak.py [--minutes 10] [--sessions 64] [--turns 32] [--keep-ended] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gateway as gateway_bench  # noqa: E402 - bench/gateway.py: the HTTP client
from _gateway_server import start_ours  # noqa: E402 - the gateway as a run starts it
from _smoke import parse_args  # noqa: E402


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- gateway process ------------------------------------------------------------------------------------


def serve(log_dir: str, keep_ended: bool) -> None:
    """Serve, and answer one JSON line per stdin command: `open N` (keys), `end` (close them), `rss`."""
    from relax_pipeline.tracking.logs import run_logging

    with run_logging(Path(log_dir)):
        asyncio.run(_serve(keep_ended))


async def _serve(keep_ended: bool) -> None:
    from relax_pipeline.turn.sessions import Status

    server, store = await start_ours()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"port": server.port}), flush=True)
    live: list[Any] = []
    while line := (await reader.readline()).decode().split():
        if line[0] == "open":
            live = [store.open(f"g-{len(store)}", i, 0, "train", {}) for i in range(int(line[1]))]
            for session in live:
                store.set_status(session, Status.RUNNING)
            answer: dict[str, Any] = {"keys": [s.key for s in live]}
        elif line[0] == "end":
            for session in live:
                store.set_status(session, Status.COMPLETED)
                if not keep_ended:
                    store.release(session)
            answer = {"ended": len(live)}
        else:
            gc.collect()
            answer = {"rss": rss_bytes(), "held": sum(1 for s in store if s.forest.nodes),
                      "tokens": sum(len(n.token_ids) for s in store for n in s.forest.nodes)}
        print(json.dumps(answer), flush=True)
    await server.stop()


# --- load process ---------------------------------------------------------------------------------------


class Gateway:
    """The `--serve` process and its command channel."""

    def __init__(self, log_dir: str, keep_ended: bool) -> None:
        flags = ["--keep-ended"] if keep_ended else []
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", "--log-dir", log_dir, *flags],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port: int = self.ask("")["port"]

    def ask(self, command: str) -> dict[str, Any]:
        if command:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


async def wave(gateway: Gateway, sessions: int, turns: int) -> tuple[int, int]:
    """One wave: `sessions` sessions at once, `turns` turns each; (requests, errors)."""
    keys = gateway.ask(f"open {sessions}")["keys"]
    try:
        load = await gateway_bench.drive(gateway.port, keys, sessions, turns)
        requests, errors = len(load.latencies), 0
    except Exception as error:  # noqa: BLE001 - any failed request is an error of the soak
        print(f"error: {type(error).__name__}: {error}", flush=True)
        requests, errors = 0, 1
    gateway.ask("end")
    return requests, errors


def report(label: str, memory: dict[str, Any], elapsed: float) -> None:
    print(f"{label:>6} t={elapsed:7.1f}s RSS {memory['rss'] / 2**20:8.1f} MiB  sessions holding a forest "
          f"{memory['held']:4d}  stored tokens {memory['tokens']}", flush=True)


async def soak(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as log_dir:
        gateway = Gateway(log_dir, args.keep_ended)
        try:
            return await _waves(gateway, args)
        finally:
            gateway.close()


async def _waves(gateway: Gateway, args: argparse.Namespace) -> int:
    started, requests, errors, waves = time.monotonic(), 0, 0, 0
    middle_due, readings = started + args.minutes * 30, {}
    while True:
        done, failed = await wave(gateway, args.sessions, args.turns)
        requests, errors, waves = requests + done, errors + failed, waves + 1
        now = time.monotonic()
        if waves == 1:
            readings["start"] = gateway.ask("rss")
            report("start", readings["start"], now - started)
        if "middle" not in readings and now >= middle_due:
            readings["middle"] = gateway.ask("rss")
            report("middle", readings["middle"], now - started)
        if now - started >= args.minutes * 60:
            break
    readings["end"] = gateway.ask("rss")
    report("end", readings["end"], now - started)
    growth = (readings["end"]["rss"] - readings["start"]["rss"]) / 2**20
    print(f"waves {waves} × {args.sessions} sessions × {args.turns} turns: {requests} requests, {errors} errors, "
          f"{requests / (now - started):.0f} requests/s; RSS growth start→end {growth:+.1f} MiB", flush=True)
    return 1 if errors or growth > args.max_growth_mib else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--max-growth-mib", type=float, default=64.0)
    parser.add_argument("--keep-ended", action="store_true",
                        help="never release ended sessions (the store before issue 17: every forest stays)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", help=argparse.SUPPRESS)
    args = parse_args(parser, minutes=0.05, sessions=4, turns=2)
    if args.serve:
        serve(args.log_dir, args.keep_ended)
        return
    sys.exit(asyncio.run(soak(args)))


if __name__ == "__main__":
    main()
