"""`--mode=serve`: the model behind HTTP, OpenAI's and vLLM's API over the
engine's running batch, and Prometheus metrics."""
