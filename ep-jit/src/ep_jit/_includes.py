"""The transitive closure of the local headers a source includes, with a content digest of each.

Every ``#include "x"`` / ``#include <x>`` is resolved the way the compiler does it (quotes: the
including file's directory first, then the include dirs; angles: the include dirs). Headers that
resolve inside an include dir are hashed and scanned in turn; the rest (the toolkit's and the
system's headers) are covered by the compiler identity. The scan is textual and over-approximates
(an include under a false ``#if`` is still hashed), which can only make keys more specific. A computed
include (``#include MACRO``) cannot be followed, so then every file under the include dirs is hashed.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence

__all__ = ["include_closure"]

_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\n]+)"|<([^>\n]+)>)', re.M)
_COMPUTED = re.compile(rb"^[ \t]*#[ \t]*include[ \t]+[A-Za-z_]", re.M)

# (path, mtime_ns, size) -> (sha256 hex, content): re-keying in one process re-reads nothing unchanged.
_file_cache: dict[tuple[str, int, int], tuple[str, bytes]] = {}


def _read(path: str) -> tuple[str, bytes]:
    st = os.stat(path)
    ck = (path, st.st_mtime_ns, st.st_size)
    hit = _file_cache.get(ck)
    if hit is None:
        with open(path, "rb") as f:
            data = f.read()
        hit = (hashlib.sha256(data).hexdigest(), data)
        if len(_file_cache) > 4096:
            _file_cache.clear()
        _file_cache[ck] = hit
    return hit


def _resolve(name: str, quoted_from: str | None, roots: Sequence[str]) -> tuple[str, str] | None:
    """(absolute path, name relative to the root it was found under) or None when not local."""
    if quoted_from is not None:
        cand = os.path.normpath(os.path.join(quoted_from, name))
        if os.path.isfile(cand):
            return cand, _relative(cand, roots)
    for root in roots:
        cand = os.path.normpath(os.path.join(root, name))
        if os.path.isfile(cand):
            return cand, _relative(cand, roots)
    return None


def _relative(path: str, roots: Sequence[str]) -> str:
    for i, root in enumerate(roots):
        if path.startswith(root + os.sep):
            return f"{i}:{os.path.relpath(path, root)}"
    return os.path.abspath(path)


def include_closure(source: str, include_dirs: Sequence[str | os.PathLike[str]]) -> list[tuple[str, str]]:
    """Sorted ``(name, sha256)`` of every local header reached from ``source`` (recursively).

    ``name`` is ``"<index of include dir>:<path under it>"``, so moving a header tree to another
    prefix (another virtualenv) keeps the key, while any content change alters it.
    """
    roots = [os.path.realpath(os.fspath(d)) for d in include_dirs]
    seen: dict[str, tuple[str, str]] = {}
    computed = False
    stack: list[tuple[bytes, str | None]] = [(source.encode(), None)]
    while stack:
        text, directory = stack.pop()
        if not computed and _COMPUTED.search(text):
            computed = True
        for m in _INCLUDE.finditer(text):
            quoted, angled = m.group(1), m.group(2)
            name = (quoted or angled).decode(errors="replace")
            found = _resolve(name, directory if quoted else None, roots)
            if found is None or found[0] in seen:
                continue
            path, rel = found
            digest, data = _read(path)
            seen[path] = (rel, digest)
            stack.append((data, os.path.dirname(path)))
    if computed:
        for root in roots:
            for dirpath, dirnames, filenames in os.walk(root):
                dirnames.sort()
                for fn in sorted(filenames):
                    path = os.path.join(dirpath, fn)
                    if path not in seen and os.path.isfile(path):
                        seen[path] = (_relative(path, roots), _read(path)[0])
    return sorted(set(seen.values()))
