"""``KernelPlan``: which kernel each projection shape of a loaded model runs through, chosen once.

A backend may time a few kernels for a product shape at load (torch: oneDNN's packed weights,
column blocks, MKL; MindSpore: a padded output width) and keep the fastest. Timing is noisy, so
two processes timing the same shape may choose differently, and the kernels' sums differ in the
last bits: a result would then depend on timing. So a choice is made once per host and shape and
kept: ``kernels="auto"`` reads the host's plan from the cache folder, times only the shapes it has
never seen (under a file lock, so concurrent processes never choose twice) and writes them back;
every later process on the host runs the same kernels. ``kernels="plain"`` runs the framework's
plain products; ``kernels="path.json"`` pins a recorded plan (``KernelPlan.save``). The plan is
held by the model (``model.kernel_plan``), printable, and never changes after load.

``$HYPER_GEN_KERNELS`` sets the default of ``load_model(kernels=...)``; ``$HYPER_GEN_CACHE_DIR``
(else ``$XDG_CACHE_HOME/hyper_gen``, else ``~/.cache/hyper_gen``) is where host plans live.
No framework is imported here: backends pass their name, version and thread count.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from typing import Callable, Dict, Iterable, Optional

from hyper_gen import host

MODES = ("auto", "plain")
FORMAT = 1  # the plan file's format version


def check_spec(kernels) -> str:
    """``kernels`` as given to ``load_model`` (None: ``$HYPER_GEN_KERNELS``, else "auto"), checked
    before any work: "auto", "plain" or the path of an existing plan file ending in ``.json``."""
    source = "kernels"
    if kernels is None:
        kernels = os.environ.get("HYPER_GEN_KERNELS", "auto")
        source = "HYPER_GEN_KERNELS"
    if isinstance(kernels, os.PathLike):
        kernels = os.fspath(kernels)
    if not isinstance(kernels, str):
        raise TypeError(f"{source} must be 'auto', 'plain' or a plan .json path, got {type(kernels).__name__}")
    if kernels in MODES:
        return kernels
    if not kernels.endswith(".json"):
        raise ValueError(f"{source} must be 'auto', 'plain' or a plan .json path, got {kernels!r}")
    if not os.path.isfile(kernels):
        raise ValueError(f"{source}={kernels!r}: no such kernel plan file")
    return kernels


def cache_dir() -> str:
    base = os.environ.get("HYPER_GEN_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "hyper_gen")
    return os.path.join(base, "kernels")


def host_key(backend: str, framework_version: str, threads: int) -> str:
    """What a timed choice depends on besides the shape: the CPU (model and ISA), the framework
    build and the threads the products run on."""
    model, isa = host.cpu_model_and_flags()
    return f"{backend}-{framework_version}|{model}|{'+'.join(isa)}|{threads} threads"


class KernelPlan:
    """The kernel of each product shape (``key`` -> kernel name, both strings the backend makes),
    for one backend on one host. ``mode`` is "auto" (unseen shapes timed once and cached on disk),
    "plain" (every shape the framework's plain product) or "pinned" (a recorded plan; an unseen
    shape is a ValueError)."""

    def __init__(self, backend: str, host: str, mode: str, choices: Optional[Dict[str, str]] = None, path=None):
        self.backend, self.host, self.mode, self.path = backend, host, mode, path
        self.choices: Dict[str, str] = dict(choices or {})
        self._allowed: Optional[Callable[[str], bool]] = None  # set by ``check``

    @classmethod
    def open(cls, kernels, backend: str, framework_version: str, threads: int) -> "KernelPlan":
        """The plan a model loads with: ``kernels`` as ``check_spec`` takes it."""
        spec = check_spec(kernels)
        key = host_key(backend, framework_version, threads)
        if spec == "plain":
            return cls(backend, key, "plain")
        if spec == "auto":
            digest = hashlib.sha256(key.encode()).hexdigest()[:16]
            path = os.path.join(cache_dir(), f"{backend}-{digest}.json")
            return cls(backend, key, "auto", _read(path, backend).get("choices", {}), path)
        recorded = _read(spec, backend)
        return cls(backend, recorded.get("host", key), "pinned", recorded.get("choices", {}), spec)

    def choose(self, key: str, measure: Callable[[], str], plain: Optional[str] = "plain") -> str:
        """The kernel for ``key``: ``plain`` under "plain", the recorded one if any, else (auto)
        ``measure()``, timed once for this host under the cache's lock and written back. ``plain=None``:
        a choice that is a checked property rather than a speed (a batch-invariant row quantum), made
        by ``measure()`` under "plain" too, and kept in the plan (not on disk)."""
        if self.mode == "plain":
            if plain is None:
                self.choices.setdefault(key, str(measure()))
                return self.choices[key]
            return plain
        if key in self.choices:
            return self.choices[key]
        if self.mode == "pinned":
            raise ValueError(f"kernel plan {self.path!r} has no kernel for {key!r}; record one with kernels='auto'")
        with _locked(self.path):
            stored = _read(self.path, self.backend).get("choices", {})  # another process may have timed it
            self.choices.update({k: v for k, v in stored.items() if self._allowed is None or self._allowed(v)})
            if key not in self.choices:
                self.choices[key] = str(measure())
                _write(self.path, self.to_dict(stored))
        return self.choices[key]

    def check(self, allowed: Callable[[str], bool]) -> None:
        """Every recorded kernel of a pinned plan is one this backend runs (a plan from elsewhere):
        a ValueError naming the first that is not. The host's cache ("auto") is shared by every
        version of hyper_gen on the host: a kernel another version recorded there that this one
        does not run is left in the file and never run (its shape is timed again if asked)."""
        self._allowed = allowed
        for key, kernel in list(self.choices.items()):
            if allowed(kernel):
                continue
            if self.mode == "auto":
                del self.choices[key]
                continue
            raise ValueError(f"kernel plan {self.path!r}: {key!r} -> {kernel!r} is not a {self.backend} kernel")

    def used(self, keys: Iterable[str]) -> "KernelPlan":
        """This plan narrowed to ``keys`` (what one model runs), for ``model.kernel_plan``."""
        keys = set(keys)
        return KernelPlan(
            self.backend, self.host, self.mode, {k: v for k, v in self.choices.items() if k in keys}, self.path
        )

    def to_dict(self, base: Optional[Dict[str, str]] = None) -> dict:
        choices = dict(base or {})
        choices.update(self.choices)
        return {"format": FORMAT, "backend": self.backend, "host": self.host, "choices": dict(sorted(choices.items()))}

    def save(self, path) -> None:
        """Write the plan as JSON, to pin it later with ``load_model(..., kernels=path)``."""
        _write(os.fspath(path), self.to_dict())

    def __str__(self) -> str:
        lines = [f"kernel plan ({self.backend}, {self.mode}; {self.host})"]
        lines += [f"  {key}: {kernel}" for key, kernel in sorted(self.choices.items())]
        return "\n".join(lines if self.choices else lines + ["  (no product timed: every shape plain)"])

    __repr__ = __str__


def _read(path: str, backend: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        raise ValueError(f"kernel plan {path!r} is not a readable plan: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("choices"), dict):
        raise ValueError(f"kernel plan {path!r} has no 'choices' object")
    if data.get("backend") not in (None, backend):
        raise ValueError(f"kernel plan {path!r} is for backend {data.get('backend')!r}, not {backend!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["choices"].items()):
        raise ValueError(f"kernel plan {path!r}: every choice must map a str key to a str kernel")
    return data


def _write(path: str, data: dict) -> None:
    """Atomically (a reader never sees half a file)."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(temp, path)


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock beside the plan file for the time one shape is timed and written: two
    processes loading at once time it once (the second reads the first's choice)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
