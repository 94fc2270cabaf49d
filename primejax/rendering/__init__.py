"""Renderers: chat messages (and tool schemas) to token ids and sampled ids back to a message.

`renderer.py` holds the protocol, `build_renderer` and the chat-template fallback; `qwen3_renderer.py` is
primejax's own Qwen3 renderer; `renderers_adapter.py` wraps the `renderers` package's families. Both the
environments (envs/) and the orchestrator import them; they import neither.
"""
