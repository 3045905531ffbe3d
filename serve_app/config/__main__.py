"""``python -m serve_app.config`` prints the README config reference;
``python -m serve_app.config --write-readme [README.md]`` rewrites it in place."""

import sys

from serve_app.config.reference import reference_markdown, write_readme_reference

if sys.argv[1:2] == ["--write-readme"]:
    write_readme_reference(sys.argv[2] if len(sys.argv) > 2 else "README.md")
else:
    print(reference_markdown())
