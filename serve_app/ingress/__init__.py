"""The HTTP ingress (the Router deployment) and the parts it is built from.

``router`` wires them and declares the routes; ``openai`` is the OpenAI wire format, one
module per endpoint; ``serving`` what every endpoint uses (model lookup, cached answer,
payload log); ``http_errors`` the one error boundary; ``middleware``, ``notes``,
``caller`` and ``auth`` what wraps every request; ``model_client`` and
``call_gathering`` the typed calls to model deployments; ``response_cache`` the cache
protocol; ``status`` /healthz and /v1/stats.
"""
