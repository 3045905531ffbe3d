"""Extra applications that integration tests deploy beside the session's two."""

SMALL = {"num_cpus": 0.05, "torch_threads": 1}


def extra_app(name: str, model: dict, *, router: dict | None = None, **args) -> dict:
    """An application at /<name> serving one model, with a small router; ``args`` adds
    sections of the app's config (cache, auth, load_profiles)."""
    return {
        "name": name,
        "route_prefix": f"/{name}",
        "import_path": "serve_app.app:build_app",
        "args": {"router": {"num_cpus": 0.05, **(router or {})}, "models": [model], **args},
    }


def profiled_app(name: str, model_dir, profile: dict) -> dict:
    """The tiny embedding model scaled by ``profile``, without a cache."""
    model = {"name": "tiny-embed", "source": str(model_dir), "task": "embedding", "engine": "transformers",
             "load_profile": "profile", "resources": SMALL}
    return extra_app(name, model, cache={"enabled": False}, load_profiles={"profile": profile})
