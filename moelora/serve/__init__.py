"""Serving: the continuous-batching engine (:mod:`moelora.serve.engine`, no HTTP dependency) and the
OpenAI-compatible HTTP API on it (:mod:`moelora.serve.api`, ``pip install "moelora[serve]"``)."""
