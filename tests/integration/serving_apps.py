"""Extra applications that integration tests deploy beside the session's two."""


def profiled_app(name: str, model_dir, profile: dict) -> dict:
    """An extra application at /<name>: the tiny embedding model scaled by ``profile``."""
    return {
        "name": name,
        "route_prefix": f"/{name}",
        "import_path": "serve_app.app:build_app",
        "args": {
            "router": {"num_cpus": 0.05},
            "cache": {"enabled": False},
            "load_profiles": {"profile": profile},
            "models": [{
                "name": "tiny-embed",
                "source": str(model_dir),
                "task": "embedding",
                "load_profile": "profile",
                "resources": {"num_cpus": 0.05, "torch_threads": 1},
            }],
        },
    }
