"""The restart index: what one process worked out, found again by the next without sympy or Jinja.

A serving process restarts often, and its first call of a known mod used to
pay for sympy (the canonical form, ~0.2-3 s to import alone), Jinja (the
kernel module's source) and the planner's analyses again, although a previous
process computed exactly the same. The index keeps those results in the cache
directory (``$FLEXGEN_CACHE_DIR/index/``), one small JSON file per entry:

- ``lowered``: a mod's lowered form (``flexgen.frontend.program.lowered_form``:
  its program text, name dropped, data constants as parameters) -> the lowered mod's facts
  (``flexgen.frontend.lowering``: canonical text, printed snippet, buffer
  signatures, the facts the planner reads, the block-bounds program);
- ``module``: a kernel spec's key -> its rendered module source
  (``flexgen.codegen.cache``);
- ``binary``: a launch's specialization (spec key, argument classes,
  constexprs, GPU, Triton's compiler key and options) -> the cubin and its
  parameter layout (``flexgen.runtime.driver``): a warm process launches it
  without Triton's specialization or compile path.

Every key is computed without sympy (a program text, a spec key), so the
planner asks the index first, falls back to the full path on a miss, and
records what it computed. Triton's own cache still holds what it compiled.

Why entries can be trusted. The module cache's rule is that no change to the
cache directory can make flexgen run code it did not generate itself: it used
to render every module and only compare the file with it. A ``module`` entry
is executed without rendering, so each entry carries an HMAC-SHA256 over
(format, fingerprint, kind, key, value) under a random 256-bit key kept in
``index.key``, a file of the user's, mode 0600, in the user's 0700 cache
directory (checked on every read: owner, type, no access for group or others).
An entry is used only when its MAC verifies; anything else (edited, planted,
truncated, moved under another key, written for another flexgen) is ignored
and recomputed. Forging an entry needs the key; reading the key needs the
user's own file permissions, and whoever has those can already run code as
the user (edit their shell profile, their site-packages). So the guarantee
is the same as before: someone who cannot act as the user cannot make
flexgen run code it did not produce. A key file someone else could have read
is replaced, which invalidates every entry made under it.

The fingerprint ties entries to the code that produced them: flexgen's own
sources and templates (hashed whole, so an edited checkout without a version
bump does not reuse stale sources) and the versions of triton, sympy and
jinja2. ``FLEXGEN_RESTART_INDEX=0`` turns the index off.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import threading
from pathlib import Path

FORMAT = 1
KEY_FILE = "index.key"
FOLDER = "index"
_MEMO_MAX = 4096

_memo: dict = {}                 # (kind, key) -> value (verified or just computed)
_lock = threading.Lock()
_state: dict = {}                # "fingerprint", "secret" (bytes or None), "folder"
STATS = {"hits": 0, "misses": 0, "rejected": 0, "written": 0}


def enabled() -> bool:
    return os.environ.get("FLEXGEN_RESTART_INDEX", "1") != "0"


# ---------------------------------------------------------------------------------- fingerprint

def _version(name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"


def fingerprint() -> str:
    """A hash of what the indexed results depend on: flexgen's sources (package, mods,
    templates) and the versions of triton, sympy and jinja2. Computed once per process
    (a few ms: the files are small)."""
    found = _state.get("fingerprint")
    if found is None:
        import importlib.resources

        from .. import __version__
        h = hashlib.sha256(f"flexgen {__version__}".encode())
        for name in ("triton", "sympy", "jinja2"):
            h.update(f"\n{name} {_version(name)}".encode())
        package = Path(__file__).resolve().parent.parent
        folders = [package, Path(str(importlib.resources.files("flexgen.templates"))),
                   Path(str(importlib.resources.files("flexgen.mods")))]
        for folder in folders:
            for path in sorted(folder.rglob("*")):
                if path.suffix in (".py", ".jinja") and path.is_file() and "__pycache__" not in path.parts:
                    h.update(b"\0" + str(path.relative_to(folder)).encode() + b"\0")
                    h.update(path.read_bytes())
        found = _state["fingerprint"] = h.hexdigest()
    return found


# ---------------------------------------------------------------------------------- the key

def _read_secret(path: Path) -> bytes | None:
    """The key in ``path`` if it is a regular file of the user's that nobody else can read or
    write; None for anything else."""
    from .cache import _read_private
    raw = _read_private(path, forbidden=0o077)
    if raw is None:
        return None
    try:
        secret = bytes.fromhex(raw.strip().decode("ascii"))
    except ValueError:
        return None
    return secret if len(secret) == 32 else None


def _new_secret(path: Path) -> bytes | None:
    """Write a fresh random key to ``path`` (0600, replacing whatever is there) and return
    the key the file holds afterwards (another process may have raced us: then theirs)."""
    secret = secrets.token_bytes(32)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-key-")     # 0600, O_EXCL
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secret.hex().encode("ascii"))
                f.flush()
                os.fsync(f.fileno())
            if _read_secret(path) is None:
                # Missing or untrustworthy: replace it (rename is atomic; a racing writer's
                # key wins or ours does, and both then read the same file below).
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except OSError:
        return None
    return _read_secret(path)


def _secret_and_folder():
    """(key, the cache directory) or (None, None) where no private directory can be used."""
    from .cache import _private_dir, cache_dir
    where = cache_dir()
    if "secret" not in _state or _state.get("where") != where:
        _state["where"] = where
        folder = _private_dir()
        secret = None
        if folder is not None:
            path = folder / KEY_FILE
            secret = _read_secret(path) or _new_secret(path)
        _state["secret"], _state["folder"] = secret, folder
    return _state["secret"], _state["folder"]


# ---------------------------------------------------------------------------------- entries

def _payload(kind: str, key: str, value) -> bytes:
    return json.dumps([FORMAT, fingerprint(), kind, key, value], sort_keys=True,
                      separators=(",", ":")).encode("utf-8")


def _path(folder: Path, kind: str, key: str) -> Path:
    name = hashlib.sha256(json.dumps([FORMAT, fingerprint(), kind, key]).encode("utf-8")).hexdigest()
    return folder / FOLDER / f"{kind}-{name[:40]}.json"


def get(kind: str, key: str, memo: bool = True):
    """The value recorded for (kind, key), verified; None when there is none (or it fails).
    ``memo=False`` for a large value its caller keeps itself (a kernel binary)."""
    memo_key = (kind, key)
    hit = _memo.get(memo_key)
    if hit is not None or not enabled():
        return hit
    secret, folder = _secret_and_folder()
    if secret is None:
        return None
    from .cache import _read_private
    data = _read_private(_path(folder, kind, key))
    if data is None:
        STATS["misses"] += 1
        return None
    try:
        entry = json.loads(data)
        value, mac = entry["value"], entry["mac"]
        ok = isinstance(mac, str) and hmac.compare_digest(
            mac, hmac.new(secret, _payload(kind, key, value), hashlib.sha256).hexdigest())
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        STATS["rejected"] += 1
        return None
    STATS["hits"] += 1
    if memo:
        _remember(memo_key, value)
    return value


def put(kind: str, key: str, value, memo: bool = True) -> None:
    """Record ``value`` (JSON data) for (kind, key). Best effort: a directory that cannot be
    written costs only the next process's time (the module cache warns once about it)."""
    if memo:
        _remember((kind, key), value)
    if not enabled():
        return
    secret, folder = _secret_and_folder()
    if secret is None:
        return
    mac = hmac.new(secret, _payload(kind, key, value), hashlib.sha256).hexdigest()
    text = json.dumps({"kind": kind, "value": value, "mac": mac}, separators=(",", ":"))
    path = _path(folder, kind, key)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        from .cache import _write_atomically
        _write_atomically(path, text)
        STATS["written"] += 1
    except OSError:
        pass


def _remember(memo_key, value) -> None:
    with _lock:
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        _memo[memo_key] = value


def clear_memos() -> None:
    """Forget what this process read or recorded (the files stay), and the key and directory
    (read again on next use: ``FLEXGEN_CACHE_DIR`` may have changed)."""
    _memo.clear()
    _state.pop("secret", None)
    _state.pop("folder", None)


__all__ = ["get", "put", "fingerprint", "enabled", "clear_memos", "STATS"]
