"""``python -m serve_app.config`` prints the config reference;
``python -m serve_app.config --write [docs/configuration.md]`` rewrites it in place."""

import sys

from serve_app.config.reference import reference_markdown, write_reference

if sys.argv[1:2] == ["--write"]:
    write_reference(sys.argv[2] if len(sys.argv) > 2 else "docs/configuration.md")
else:
    print(reference_markdown())
