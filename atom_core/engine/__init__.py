"""The engine: scheduler, KV cache, model runner, and the APIs over them."""
