"""``dsaspec serve``: an OpenAI-compatible HTTP server over the Engine (see docs/serving.md).

Needs the ``serve`` extra (starlette, uvicorn, prometheus-client, tokenizers, jinja2); nothing
else in dsaspec imports this package.
"""
