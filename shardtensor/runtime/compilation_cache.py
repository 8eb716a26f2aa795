"""JAX's persistent compilation cache for shardtensor's programs: ``initialize_cache`` and the check
that drops an unreadable entry instead of failing the program that loads it."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import warnings

import jax

_CACHE = None  # (absolute path, readonly) once initialize_cache ran
PROGRAMS_ENV = "SHARDTENSOR_PROGRAM_CACHE"  # 0: JAX's cache only, no shardtensor program entries
PROGRAMS_DIRECTORY = "shardtensor-programs"


def initialize_cache(path: str | os.PathLike[str], readonly: bool = False) -> None:
    """Keep compiled programs on disk at ``path``, so a later process running the same program
    loads them instead of compiling (JAX's persistent compilation cache).

    Every program is cached, however small or quick to compile. A second process counts
    ``PersistentCacheHit`` for each program it finds and ``PersistentCacheMiss`` for each it had to
    compile. ``readonly=True`` reads the cache and never writes to it, e.g. one cache filled by one
    host and shared by many; the directory must exist. Call it once per process, before the first
    compilation you want cached; calling it again with the same arguments does nothing.

    shardtensor also keeps each of its own programs there, under its own key (the recorded graph's,
    known before anything is traced; ``graph.program_store``): a later process running the same
    graph calls the stored executable without tracing or lowering the program again, which JAX's
    cache must do to find its entry. ``SHARDTENSOR_PROGRAM_CACHE=0`` leaves that out. The
    executables in a cache are machine code: use a directory only you (or whom you trust) can write.

    A cache belongs to its path: JAX's keys include the path of XLA's GPU autotuning cache (a
    subdirectory), so a copied or moved cache directory finds nothing. On GPU that autotuning
    cache is still updated by process 0 in readonly mode (JAX decides; turning it off would change
    the keys).

    Example::

        import shardtensor as st
        st.initialize_cache("/tmp/shardtensor_cache")
        ...   # the first run compiles and writes; later runs load
        st.counter_value("PersistentCacheHit")
    """
    global _CACHE
    absolute = os.path.abspath(os.fspath(path))
    readonly = bool(readonly)
    if _CACHE is not None:
        if _CACHE == (absolute, readonly):
            return
        raise RuntimeError(
            f"The persistent compilation cache has already been initialized at {_CACHE[0]!r} "
            f"(readonly={_CACHE[1]}); it cannot change to {absolute!r} (readonly={readonly}) in the "
            "same process. Call initialize_cache once, at start-up, or use another process."
        )
    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # (the same)
    if current and os.path.abspath(current) != absolute:
        raise RuntimeError(
            f"JAX's compilation cache is already set to {current!r} (JAX_COMPILATION_CACHE_DIR or "
            f"jax.config), not {absolute!r}; one process has one cache. Unset it or pass the same path."
        )
    if readonly and not os.path.exists(absolute):
        raise FileNotFoundError(
            f"initialize_cache({absolute!r}, readonly=True): the directory does not exist, and a "
            "read-only cache never creates it. Fill it first with a run that has readonly=False."
        )
    problem = _unusable(absolute, readonly)
    if problem is not None:
        if (absolute, readonly) not in _WARNED:
            _WARNED.add((absolute, readonly))
            warnings.warn(
                f"st.initialize_cache({absolute!r}): {problem}, so the persistent compilation cache is off "
                "(programs compile as usual, nothing is kept on disk). Pass a directory this process can "
                f"{'read' if readonly else 'write'}.",
                RuntimeWarning,
                stacklevel=2,
            )
        return
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", absolute)
    # JAX skips programs that compile in under a second or are small; shardtensor caches all.
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if readonly:
        # JAX writes an entry only if it took at least this long to compile: never. Reads are
        # unaffected, and without a size limit (-1) reading does not touch access-time files.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
        jax.config.update("jax_compilation_cache_max_size", -1)
    else:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX decides once per process whether the cache is in use; make it decide again now.
    compilation_cache.reset_cache()
    _check_entries_on_load(readonly)
    _CACHE = (absolute, readonly)


def program_cache() -> tuple[str, bool] | None:
    """(directory of shardtensor's program entries, readonly) while ``initialize_cache`` is on and
    ``SHARDTENSOR_PROGRAM_CACHE`` is not 0; else None.

    Example::

        st.initialize_cache("/tmp/c"); program_cache()   # ('/tmp/c/shardtensor-programs', False)
    """
    if _CACHE is None:
        return None
    if os.environ.get(PROGRAMS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return os.path.join(_CACHE[0], PROGRAMS_DIRECTORY), _CACHE[1]


_WARNED: set = set()  # unusable (path, readonly) pairs already reported


def _unusable(path: str, readonly: bool) -> str | None:
    """Why ``path`` cannot hold a compilation cache (None: it can), found now rather than as a
    warning per compilation or, for a file in the way, caching silently off."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "the path is a file, not a directory"
    if readonly:
        return None if os.access(path, os.R_OK | os.X_OK) else "the directory is not readable"
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"the directory cannot be written ({type(e).__name__}: {e.strerror or e})"
    return None


class _CheckedEntries:
    """JAX's on-disk cache with each entry checked as it is loaded: an entry that cannot be read back
    (truncated, overwritten) is reported, removed so that the program compiled again replaces it
    (JAX never overwrites an entry), and treated as a miss."""

    def __init__(self, base, readonly: bool):
        self._base, self._readonly = base, readonly

    def get(self, key):
        from jax._src import compilation_cache as jax_cache

        if getattr(_AFRESH, "on", False):
            return None
        value = self._base.get(key)
        if value is None:
            return None
        try:
            jax_cache.extract_executable_and_time(jax_cache.decompress_executable(value))
        except Exception as e:  # noqa: BLE001 — zlib, zstd and the framing raise their own; a miss then
            self._drop(key, e)
            return None
        return value

    def _drop(self, key, error) -> None:
        directory = getattr(self._base, "path", None) or getattr(self._base, "_path", "")  # LRUCache / a wrapper
        path = os.path.join(str(directory), f"{key}-cache")
        removed = False
        if not self._readonly:
            try:
                os.remove(path)
                removed = True
            except OSError:
                pass
        warnings.warn(
            f"The persistent compilation cache entry {path} cannot be loaded ({type(error).__name__}: {error}); "
            "the program is compiled again" + (" and the entry replaced." if removed else "."),
            RuntimeWarning,
            stacklevel=2,
        )

    def __getattr__(self, name):  # put, clear, path ...: JAX's own
        return getattr(self._base, name)


_AFRESH = threading.local()


@contextlib.contextmanager
def compiling_afresh():
    """Inside the block, this thread's compilations find nothing in JAX's persistent cache: XLA
    really compiles (and JAX writes its entry if it has none). shardtensor stores an executable in
    its own program cache only when XLA built it in this process: one that JAX loaded from its
    cache does not serialize whole on CPU (running it again after a round trip fails with
    "Function ... not found").

    Example::

        with compiling_afresh():
            compiled = jitted.lower(*args).compile()   # never a JAX cache hit
    """
    previous, _AFRESH.on = getattr(_AFRESH, "on", False), True
    try:
        yield
    finally:
        _AFRESH.on = previous


def _check_entries_on_load(readonly: bool) -> None:
    """Put ``_CheckedEntries`` in front of JAX's file cache (built now instead of at the first
    compilation). Should JAX's internals differ, its own behaviour stays: a warning per failed load."""
    from jax._src import compilation_cache as jax_cache

    if not hasattr(jax_cache, "_initialize_cache") or getattr(jax_cache, "_cache", None) is not None:
        return
    jax_cache._initialize_cache()
    if jax_cache._cache is not None:
        jax_cache._cache = _CheckedEntries(jax_cache._cache, readonly)  # type: ignore[assignment]  # a wrapper


# --------------------------------------------------------------------------- joining a multi-process job
