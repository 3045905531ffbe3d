"""The HTTP ingress (the Router deployment) and the parts it is built from.

``router`` wires them and declares the endpoints; ``protocol`` is the OpenAI wire
format; ``http_errors`` the one error boundary; ``middleware`` and ``notes`` what
wraps every request; ``model_client`` the typed calls to model deployments;
``response_cache`` the cache protocol; ``status`` /healthz and /v1/stats.
"""
