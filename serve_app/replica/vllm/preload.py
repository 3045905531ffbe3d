"""What the engine process server (:mod:`serve_app.replica.vllm.engine_process`) runs
before it forks anything: it imports the modules the replica named (vLLM's engine core
and CPU worker, 9 s of imports on 2 cores), then writes its environment, as those imports
left it, to the file the replica named, which compares it with the environment vLLM
starts its engine core in. A failed import leaves the child to import what it needs, as
a spawned one does; it must not stop the server, which a raised error would."""

import importlib
import json
import os

_request = json.loads(os.environ.pop("SERVE_APP_VLLM_PRELOAD_REQUEST", "") or "{}")
for _module in _request.get("modules", ()):
    try:
        importlib.import_module(_module)
    except Exception:  # noqa: BLE001
        pass
if _request.get("report"):
    try:
        with open(f"{_request['report']}.tmp", "w") as _f:
            json.dump(dict(os.environ), _f)
        os.replace(f"{_request['report']}.tmp", _request["report"])  # whole or absent for the reader
    except OSError:
        pass
