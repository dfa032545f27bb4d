"""The OpenAI-compatible HTTP server: app (FastAPI + launch), protocol (request models and
error bodies), serving (endpoint logic and SSE), logprobs (OpenAI logprob shapes), metrics."""
