"""The OpenAI wire format, one module per endpoint (as vLLM's ``entrypoints/openai``):
each holds its request body, the typed call it becomes, its response (and stream
chunks) and ``create``, the endpoint's whole answer. ``common`` and ``sampling`` hold
what endpoints share; ``streaming`` frames server-sent events.

Request-shape checks live here and only here: OpenAI's field names and ranges
(pydantic) and the limits the model's config sets (inputs per request, max_tokens,
stop sequences, top_k). What needs the model itself (token counts against the context
window) is the replica's to check.
"""
