"""The LoRA adapters an engine serves by name: which slot each holds, loading one into a free
slot, and unloading one only once the requests that run with it have finished.

The slots themselves (the adapters' tensors on the device) are ``layers/lora.py``'s
``LoRASlots``; ``ModelRunner.put_lora`` fills or empties one on every rank. An unloaded
adapter "retires": new requests may no longer name it, while its slot stays as it is until
no running or waiting request uses it (``retire``, after each finished request).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from conveyor.runtime.engine.settings import AdapterError

if TYPE_CHECKING:
    from conveyor.runtime.engine.model_runner import ModelRunner
    from conveyor.runtime.layers.lora import Adapter


class LoRATable:
    def __init__(self, runner: ModelRunner, busy_slots: Callable[[], set[int]]):
        """``busy_slots``: the slots the engine's unfinished requests run with."""
        self.runner = runner
        self.busy_slots = busy_slots
        self.retiring: dict[int, str] = {}
        """Slots of adapters unloaded while requests still ran with them -> their names."""

    def slot(self, name: str | None) -> tuple[int, str | None]:
        """The slot and key (``Sequence.lora_key``) a request naming adapter ``name`` runs
        with; (-1, None) for the base model. Raises ``AdapterError`` if it is not loaded."""
        if name is None:
            return -1, None
        lora = self.runner.model.lora
        slot = None if lora is None or name in self.retiring.values() else lora.slot_of(name)
        if lora is None or slot is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        return slot, lora.keys[slot]

    def load(self, adapter: Adapter, replace: bool = False) -> None:
        """Put ``adapter`` (``runner.read_lora``, read off the engine's thread) in a free slot,
        or with ``replace`` in place of a loaded one of its name; requests may then name it.
        Raises ``AdapterError`` where it cannot go."""
        lora = self.runner.model.lora
        if lora is None:
            raise AdapterError("this replica serves no LoRA adapters: start it with --enable-lora")
        name = adapter.name
        if name in self.retiring.values():
            raise AdapterError(
                f"LoRA adapter {name!r} is being unloaded: requests still run with it; load it "
                "again once they have finished"
            )
        slot = lora.slot_of(name)
        if slot is not None and not replace:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded; unload it first")
        if slot is None:
            slot = lora.free_slot()
        if slot is None:
            waiting = f" ({len(self.retiring)} of them unloaded, until their requests finish)"
            raise AdapterError(
                f"{lora.loaded} LoRA adapters are loaded{waiting if self.retiring else ''}, as "
                "many as --max-cpu-loras allows; unload one first"
            )
        self.runner.put_lora(slot, adapter)

    def served(self) -> dict[str, str]:
        """The adapters requests may name -> their folders (those being unloaded aside)."""
        lora = self.runner.model.lora
        if lora is None:
            return {}
        return {
            name: path
            for slot, (name, path) in enumerate(zip(lora.names, lora.paths, strict=True))
            if name is not None and path is not None and slot not in self.retiring
        }

    def unload(self, name: str) -> None:
        """New requests may no longer name the adapter; its slot is emptied once the requests
        running with it have finished. Raises ``AdapterError`` if it is not loaded."""
        lora = self.runner.model.lora
        slot = None if lora is None or name in self.retiring.values() else lora.slot_of(name)
        if slot is None:
            raise AdapterError(f"LoRA adapter {name!r} is not loaded")
        self.retiring[slot] = name
        self.retire()

    def retire(self) -> None:
        """Empty the slots of unloaded adapters that no request runs with any more."""
        if not self.retiring:
            return
        busy = self.busy_slots()
        for slot in [s for s in self.retiring if s not in busy]:
            self.runner.put_lora(slot, None)
            del self.retiring[slot]

    def stats(self, running: Iterable[Any], waiting: Iterable[Any]) -> dict[str, Any]:
        """``EngineStats``' adapter fields: the slots, and the adapters the ``running`` and
        ``waiting`` sequences name."""
        lora = self.runner.model.lora
        if lora is None:
            return {}

        def names(seqs: Iterable[Any]) -> tuple[str, ...]:
            return tuple(sorted({n for s in seqs if (n := lora.name_of(s.lora_slot)) is not None}))

        return dict(
            max_loras=lora.max_resident or len(lora.names),
            running_loras=names(running),
            waiting_loras=names(waiting),
        )
