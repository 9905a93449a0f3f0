"""``twotower serve``: one index as an HTTP search service (FastAPI + uvicorn) with a search page.

* `twotower.serve.app` — routes and `create_app(ServeConfig)`;
* `twotower.serve.batcher` — the model owner: one thread holds the encoder, reranker and a
  read-only view of the index, and micro-batches concurrent searches;
* `twotower.serve.writer` — serialised, atomically committed adds and deletes;
* `twotower.serve.auth`, `twotower.serve.limits`, `twotower.serve.errors`, `twotower.serve.stats` —
  bearer tokens, request bounds, JSON errors, request counters.

Needs the ``serve`` extra (``pip install 'twotower[serve]'``). docs/serve.md is the user's guide.
"""
