"""vLLM plugin: vLLM's own Qwen4Exp model runs its PLE kernels on ``qwen4exp_ext``.

vLLM finds :func:`register` through the ``vllm.general_plugins`` entry point ``qwen4exp`` and
calls it in every process it starts (``VLLM_PLUGINS`` filters by that name, as vLLM documents).
After it, the ``ple_ngram_ids``, ``ple_gate``, ``ple_conv`` and the PLE table lookups of every
format (``embedding`` for the device table, ``lookup_from_pinned`` for the pinned host table, of
the unquantized, FP8 and NVFP4 methods) of each vLLM release in :data:`SUPPORTED_VLLM` (0.33.0,
0.34.0) run our kernels, wherever vLLM's Qwen4Exp code calls them: the module globals of every
``vllm.models.qwen4_exp`` module that imported them, and ``torch.ops.vllm.qwen4_exp_ple_gate``,
which vLLM registered with its own function object. Pinned tables are allocated at their exact
size, vLLM's AMD layer takes NVFP4 tables, and vLLM's AMD model looks its pinned tables up at
step entry (:mod:`.prefetch`; ``QWEN4EXP_VLLM_PREFETCH=0`` turns that off). The table of swaps
is :data:`qwen4exp_ext.vllm.shims.SWAPS` (its package docstring says what differs from vLLM,
and how a row follows a release); a row whose kernel our build lacks is skipped. Each swapped
kernel runs ours or vLLM's original, whichever :mod:`.choice` measured faster for that shape
class on this GPU (``QWEN4EXP_VLLM_KERNELS=auto|ours|vllm``; ours on the CPU).

Nothing here imports vLLM until :func:`register` runs, and even then vLLM's Qwen4Exp modules are
patched only when vLLM itself imports them (a post-import hook), so processes that serve another
model pay nothing. If the installed vLLM is not a release the shims know, or one of its signatures
differs from that release's, one warning names the mismatch and vLLM is left exactly as it was.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

__all__ = ["PLUGIN_NAME", "SUPPORTED_VLLM", "register", "swapped"]

PLUGIN_NAME = "qwen4exp"
# The vLLM releases the swap table knows, oldest first (shims.SWAPS: each row's target and
# signature per release, where a release changed them). Any other release is left alone.
SUPPORTED_VLLM: tuple[str, ...] = ("0.33.0", "0.34.0")

# A child of vLLM's logger, so that our lines come out in vLLM's log, in its format.
logger = logging.getLogger("vllm.qwen4exp_ext")

_lock = threading.RLock()
_registered = False
_declined: str | None = None  # why vLLM was left as it was (warned once)
_swapped: dict[str, Callable[..., Any]] = {}  # label -> vLLM's original


def swapped() -> tuple[str, ...]:
    """The vLLM functions and methods that run our kernels in this process (empty before vLLM
    imports its Qwen4Exp code, or when the plugin is off or declined)."""
    return tuple(_swapped)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point. Safe to call any number of times."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        try:
            installed = version("vllm")
        except PackageNotFoundError:
            _decline("vLLM is not installed")
            return
        release = installed.split("+", 1)[0]
        if release not in SUPPORTED_VLLM:
            _decline(
                f"the installed vLLM is {installed}, but these shims know vLLM "
                f"{', '.join(SUPPORTED_VLLM)}"
            )
            return
        from .shims import swaps_for

        rows = swaps_for(release)
        # Each row waits for its trigger module (vLLM's PLE ops, or the AMD layer for the rows
        # that only it needs, so that an NVIDIA process never imports the AMD code).
        for trigger in dict.fromkeys(swap.trigger for swap in rows):
            if trigger in sys.modules:
                _apply(trigger, rows)
            else:
                sys.meta_path.insert(0, _PatchAfterImport(trigger, partial(_apply, trigger, rows)))


def _decline(reason: str) -> None:
    global _declined
    if _declined is None:
        _declined = reason
        logger.warning(
            "qwen4exp_ext vLLM plugin: %s; vLLM's own Qwen4Exp PLE kernels stay in place.", reason
        )


def _resolve_owner(owner: str) -> Any:
    module_name, _, cls = owner.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, cls) if cls else module


def _apply(trigger: str, rows: tuple[Any, ...]) -> None:
    """Check every row of ``rows`` (the table as the installed release has it) that
    ``trigger``'s import brings against the vLLM in this process, then swap them all, or none
    (and, after a mismatch, no later group either)."""
    from .. import ops
    from . import prefetch
    from .shims import AMD_LAYER_MODULE, MARK, signature_text

    with _lock:
        if _declined is not None:
            return
        plan: list[tuple[Any, Any, Callable[..., Any]]] = []  # (swap, owner, vLLM's function)
        try:
            for swap in (s for s in rows if s.trigger == trigger):
                if not hasattr(ops, swap.needs) or (
                    swap.applies is not None and not swap.applies()
                ):
                    logger.debug(
                        "qwen4exp_ext: ops.%s missing or the row does not apply to this build; "
                        "vLLM's %s stays",
                        swap.needs,
                        swap.label,
                    )
                    continue
                owner = _resolve_owner(swap.owner)
                current = (
                    owner.__dict__.get(swap.name)
                    if isinstance(owner, type)
                    else getattr(owner, swap.name, None)
                )
                if current is None and swap.adds:  # a method vLLM lacks: added, nothing to check
                    plan.append((swap, owner, None))
                    continue
                if current is None:
                    _decline(f"vLLM has no {swap.owner.replace(':', '.')}.{swap.name}")
                    return
                if getattr(current, MARK, None) is not None:
                    continue  # already ours
                found = signature_text(current)
                if found != swap.signature:
                    _decline(
                        f"vLLM's {swap.label} has signature {found}, expected {swap.signature}"
                    )
                    return
                plan.append((swap, owner, current))
        except Exception as exc:  # noqa: BLE001 - any surprise leaves vLLM untouched
            _decline(f"cannot inspect vLLM's Qwen4Exp code ({type(exc).__name__}: {exc})")
            return

        done: list[tuple[Any, Any, Callable[..., Any], Callable[..., Any]]] = []
        # Two rows may swap one function (e.g. the AMD embedding's __init__: the table
        # directory's row and 0.34's disk_offload row): the later one wraps the earlier's
        # replacement, not vLLM's function, so that neither is lost.
        installed: dict[tuple[int, str], Callable[..., Any]] = {}
        try:
            for swap, owner, original in plan:
                key = (id(owner), swap.name)
                wrapped = installed.get(key, original)
                replacement = _install(swap, owner, wrapped, swap.make(wrapped), MARK)
                installed[key] = replacement
                done.append((swap, owner, wrapped, replacement))
        except Exception as exc:  # noqa: BLE001 - undo, so that vLLM is exactly as it was
            for swap, owner, wrapped, replacement in reversed(done):
                _install(swap, owner, replacement, wrapped, None)
            _decline(f"swapping failed ({type(exc).__name__}: {exc})")
            return
        for swap, _, original in plan:
            _swapped[swap.label] = original  # vLLM's own function, also under a chained row
        if plan:
            logger.info(
                "qwen4exp_ext vLLM plugin: Qwen4Exp runs on qwen4exp_ext kernels: %s",
                ", ".join(s.label for s, _, _ in plan),
            )
        if trigger == AMD_LAYER_MODULE:
            logger.info(prefetch.status_line())


def _install(
    swap: Any,
    owner: Any,
    old: Callable[..., Any] | None,
    new: Callable[..., Any] | None,
    mark: str | None,
) -> Callable[..., Any] | None:
    """Puts ``new`` everywhere vLLM holds ``old``: the owner, the modules that imported it, and
    the torch.ops.vllm op registered with it. With ``mark``, ``new`` is our replacement of
    ``old`` (and says so); without, this undoes a swap."""
    from .shims import CONSUMER_PREFIX

    if new is None:  # undoing the addition of a method vLLM lacks
        delattr(owner, swap.name)
        return new
    if mark is not None and old is None:  # a method vLLM lacks (Swap.adds): marked as ours
        new.__qualname__ = f"{owner.__qualname__}.{swap.name}"
        setattr(new, mark, new)
    elif mark is not None:
        new.__qualname__ = getattr(old, "__qualname__", swap.name)
        new.__doc__ = old.__doc__
        new.__wrapped__ = old  # type: ignore[attr-defined]  (inspect.signature shows vLLM's)
        setattr(new, mark, old)
    setattr(owner, swap.name, new)
    if isinstance(owner, ModuleType):
        if swap.rebind_consumers:
            _rebind_consumers(CONSUMER_PREFIX, swap.name, old, new)
        if swap.torch_op is not None:
            _reregister_torch_op(swap.torch_op, swap.torch_op_module, new)
    return new


def _rebind_consumers(prefix: str, name: str, original: Any, replacement: Any) -> None:
    """Modules that ran ``from ..common.ops.ple import name`` before the swap hold vLLM's function
    in their own globals, and look it up there at call time."""
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(prefix) and module is not None:
            if module.__dict__.get(name) is original:
                setattr(module, name, replacement)


def _reregister_torch_op(op_name: str, defining_module: str | None, fn: Callable[..., Any]) -> None:
    """A torch.ops.vllm op keeps the function object it was registered with. If vLLM already
    registered it, register our kernel for the same dispatch key (vLLM's fake impl stays); if
    not, the module that registers it will take our function from the rebound global."""
    import torch

    if defining_module is not None and defining_module not in sys.modules:
        return
    if not hasattr(torch.ops.vllm, op_name):  # its module is still importing: it will use ours
        return
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import vllm_lib

    vllm_lib.impl(op_name, fn, dispatch_key=current_platform.dispatch_key)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` right after the module ``name`` executes, before its importer goes on
    (so ``from name import f`` in the importer already sees the swapped ``f``). One-shot."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _CallbackLoader(spec.loader, self)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _PatchAfterImport) -> None:
        self._loader = loader
        self._finder = finder

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, ... for inspect/triton
        return getattr(self._loader, attr)

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        try:
            self._finder.callback()
        except Exception as exc:  # noqa: BLE001 - never break vLLM's own import
            _decline(f"swapping failed ({type(exc).__name__}: {exc})")
