"""The model replica: the ModelServer deployment, its generation engines and its stats."""
