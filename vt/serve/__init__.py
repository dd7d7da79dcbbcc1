"""vt serve: an OpenAI-compatible HTTP server on vt's engine (the optional extra vt-graphs[serve]).

protocol (request bodies, validated), text and detok (tokenizer, chat template, incremental
text, stop strings), model_source (a Hugging Face checkpoint or a preset), generation (the
engine bridge: admission, cancel, outcome), responses (OpenAI bodies and SSE chunks), metrics
(Prometheus text), app (the FastAPI routes) and server (uvicorn, graceful stop).
docs/serve.md describes the endpoints and flags.
"""
