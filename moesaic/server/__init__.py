"""`moesaic serve`: the OpenAI- and Anthropic-compatible HTTP server. `parsers/` splits a model's output
into reasoning, content and tool calls; `chat/` renders a conversation into the family's prompt."""
