"""Decoder families, registered by Hugging Face ``model_type`` and GGUF architecture.

A :class:`Family` says how to load a checkpoint of its kind into a model that keeps the
:class:`~deft.model.contract.DecoderModel` contract. :func:`~deft.model.load_model` finds
the family of a directory by its ``config.json``'s ``model_type`` and of a GGUF file by its
``general.architecture``; a new family is one module and a :func:`register_family` call.
A kind no family loads can be refused with a reason (:func:`refuse`), named in the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Family", "families", "family_for_gguf", "family_for_hf", "refuse", "register_family",
           "unregister_family"]

# (path or opened file, device, dtype[, tp=TPGroup]) -> (model, tokenizer)
Loader = Callable[[Any, torch.device | str, torch.dtype], tuple[Any, Any]]


@dataclass(frozen=True)
class Family:
    """A decoder family: its name, the checkpoint kinds it claims and their loaders.

    ``load_hf(folder, device, dtype)`` loads a Hugging Face directory whose ``model_type``
    is in ``hf_model_types``; ``load_gguf(gguf_file, device, dtype)`` an opened
    :class:`~deft.model.gguf_file.GGUFFile` whose architecture is in ``gguf_architectures``.
    With ``tensor_parallel``, both loaders also take ``tp=`` (a
    :class:`~deft.distributed.TPGroup`) and load that rank's shard.
    """

    name: str
    hf_model_types: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    load_hf: Loader | None = None
    load_gguf: Loader | None = None
    tensor_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty family name, got {self.name!r}")
        for field, loader in (("hf_model_types", self.load_hf),
                              ("gguf_architectures", self.load_gguf)):
            kinds = getattr(self, field)
            if not isinstance(kinds, tuple) or not all(isinstance(k, str) and k for k in kinds):
                raise ValueError(f"{field}: expected a tuple of names, got {kinds!r}")
            if kinds and not callable(loader):
                raise TypeError(f"{field}: given, but its loader is {loader!r}, not a callable")


_FAMILIES: dict[str, Family] = {}
# Checkpoint kinds no family loads, by Family field -> kind -> why (said in the error).
_REFUSED: dict[str, dict[str, str]] = {"hf_model_types": {}, "gguf_architectures": {}}


def register_family(family: Family) -> None:
    """Add ``family`` (replacing one of the same name); a checkpoint kind another family
    claims raises ``ValueError``."""
    if not isinstance(family, Family):
        raise TypeError(f"family: expected a deft.model.Family, got {type(family).__name__}")
    for other in _FAMILIES.values():
        if other.name == family.name:
            continue
        clash = (set(other.hf_model_types) & set(family.hf_model_types)) | (
            set(other.gguf_architectures) & set(family.gguf_architectures))
        if clash:
            raise ValueError(f"family {family.name!r}: {', '.join(sorted(clash))} already "
                             f"claimed by family {other.name!r}")
    _FAMILIES[family.name] = family


def refuse(why: str, hf_model_types: tuple[str, ...] = (),
           gguf_architectures: tuple[str, ...] = ()) -> None:
    """Say ``why`` in the error for these checkpoint kinds while no family claims them."""
    for field, kinds in (("hf_model_types", hf_model_types), ("gguf_architectures", gguf_architectures)):
        _REFUSED[field].update(dict.fromkeys(kinds, why))


def unregister_family(name: str) -> None:
    """Remove the family ``name`` (a no-op if there is none)."""
    _FAMILIES.pop(name, None)


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


def family_for_hf(model_type: Any) -> Family:
    """The family claiming ``model_type``; ``ValueError`` lists the supported ones."""
    return _find(model_type, "hf_model_types", "model_type")


def family_for_gguf(architecture: Any) -> Family:
    """The family claiming GGUF ``architecture``; ``ValueError`` lists the supported ones."""
    return _find(architecture, "gguf_architectures", "general.architecture")


def _find(kind: Any, field: str, name: str) -> Family:
    known = [k for f in _FAMILIES.values() for k in getattr(f, field)]
    for f in _FAMILIES.values():
        if isinstance(kind, str) and kind in getattr(f, field):
            return f
    why = _REFUSED[field].get(kind) if isinstance(kind, str) else None
    raise ValueError(f"{name}: expected one of {', '.join(known)}, got {kind!r}"
                     + (f" ({why})" if why else ""))
