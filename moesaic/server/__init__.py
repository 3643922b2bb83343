"""`moesaic serve`: the OpenAI- and Anthropic-compatible HTTP server."""
