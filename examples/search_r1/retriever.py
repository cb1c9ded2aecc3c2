"""The search_r1 retrieval service: a BM25 index (bm25s) over corpus.jsonl, served over HTTP.

`python retriever.py --port PORT [--corpus data/corpus.jsonl]` builds the index at start (well under a second
for the shipped corpus), then serves on 127.0.0.1:

- `GET /health` → 200 `{"status": "ok", "documents": N}`;
- `POST /retrieve {"query": str, "topk": int = 3}` → `{"results": [{"id", "title", "text", "score"}]}`, best
  first, only documents sharing a word with the query (score > 0); a bad body is a 400 naming the field.

The run starts it once, through `agent.services.retriever` (conf/experiment/search_r1.yaml), and every session's
agent reaches it at `$SEARCH_URL`. Without bm25s it exits at once, naming the install command, and the run fails
at start with this log's tail. Not done here: dense retrieval, stemming, persistence of the index.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

try:
    import bm25s
except ImportError:  # pragma: no cover - exercised by a run without the extra
    sys.exit("retriever: the bm25s package is missing; install the examples extra: pip install -e '.[examples]'")

MAX_TOPK = 50


class Index:
    """BM25 over the documents' title and text; `search` is safe to call from many threads."""

    def __init__(self, corpus: Path) -> None:
        self.docs = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines() if line.strip()]
        texts = [f"{d['title']} {d['text']}" for d in self.docs]
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)
        self.lock = threading.Lock()

    def search(self, query: str, topk: int) -> list[dict]:
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not tokens[0]:
            return []
        with self.lock:
            ids, scores = self.bm25.retrieve(tokens, k=min(topk, len(self.docs)), show_progress=False)
        pairs = zip(ids[0], scores[0], strict=True)
        return [{**self.docs[int(i)], "score": round(float(s), 4)} for i, s in pairs if s > 0]


def handler(index: Index) -> type[BaseHTTPRequestHandler]:
    """The request handler class serving `index`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok", "documents": len(index.docs)})
            else:
                self._send(404, {"error": f"no route GET {self.path}; use GET /health or POST /retrieve"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/retrieve":
                self._send(404, {"error": f"no route POST {self.path}; use POST /retrieve"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                query, topk = body["query"], body.get("topk", 3)
                if not isinstance(query, str) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
                    raise ValueError
            except (ValueError, KeyError, TypeError, AttributeError):
                self._send(400, {"error": f'body must be {{"query": str, "topk": int 1..{MAX_TOPK}}}'})
                return
            results = index.search(query, topk)
            print(f"retrieve query={query!r} topk={topk} results={[r['id'] for r in results]}", flush=True)
            self._send(200, {"results": results})

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
            pass

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--corpus", type=Path, default=Path(__file__).parent / "data" / "corpus.jsonl")
    args = parser.parse_args()
    index = Index(args.corpus)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(index))
    print(f"retriever: {len(index.docs)} documents indexed from {args.corpus}; serving on 127.0.0.1:{args.port}",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
