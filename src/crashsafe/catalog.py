"""What a writer knows of its store's committed steps, and how it deletes them.

Each step's delta bases and referenced steps ("bases": what it needs) and facts (commit time,
metrics) are cached from the manifests the writer commits, or read once; retention deletes what its
policy drops but never a step that a kept step's delta chain or references need, dependants before
their bases, each step renamed out of view before its files go.
The manager keeps one catalog for its store, the mirror one for the mirror's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from crashsafe.chain import direct_bases, doomed_steps, protected_steps
from crashsafe.errors import CheckpointExistsError, CrashsafeError
from crashsafe.format.manifest import Manifest
from crashsafe.policies.keep import KeepPolicy, StepFacts
from crashsafe.storage.base import Store
from crashsafe.storage.writer import delete_steps

__all__ = ["Catalog"]


class Catalog:
    """The committed steps of ``store``: the steps each needs and its facts, and crash-safe deletion."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.bases: dict[int, frozenset[int]] = {}  # step -> the steps its deltas and references need
        self.facts: dict[int, StepFacts] = {}  # step -> its commit time and metrics

    def committed(self, manifest: Manifest) -> None:
        """Note a step just committed (a step saved again: anew)."""
        self.bases[manifest.step] = direct_bases(manifest)
        self.facts[manifest.step] = StepFacts(manifest.created, manifest.metrics)

    def needed(self, steps: Iterable[int]) -> frozenset[int]:
        """The steps ``steps``' delta chains and references run through (not themselves)."""
        return protected_steps(self.store, steps, self.bases)

    def retain(self, policy: KeepPolicy | None, keep: Collection[int] = ()) -> list[int]:
        """Delete what ``policy`` drops, except ``keep`` and every step a kept step needs; return them."""
        doomed = doomed_steps(self.store, policy, self.bases, keep=set(keep), facts=self.facts)
        self.delete(doomed)
        return doomed

    def delete(self, steps: Collection[int]) -> None:
        """Delete ``steps`` (dependants before their bases), and forget them."""
        delete_steps(self.store, steps)
        self.forget(steps)

    def forget(self, steps: Iterable[int]) -> None:
        """Drop what is known of ``steps`` (deleted, or saved anew)."""
        for step in steps:
            self.bases.pop(step, None)
            self.facts.pop(step, None)

    def delete_asked(self, steps: Iterable[int]) -> None:
        """Delete the committed ones of ``steps``, or none if a step that stays needs one of them."""
        committed = self.store.steps()
        doomed = sorted(set(steps) & set(committed))
        needed = sorted(self.needed(s for s in committed if s not in doomed) & set(doomed))
        if needed:
            raise CrashsafeError(
                f"cannot delete step {needed[0]}: a step that stays is a delta of it or refers to its "
                "bytes. Delete the steps that depend on it too, or keep it"
            )
        self.delete(doomed)

    def make_room(self, step: int, intact: Callable[[list[int]], bool], where: str) -> None:
        """Before ``step`` is saved again: delete it if it is damaged and no intact step needs it (a
        delta of it, or a step referring to its bytes; ``intact(steps)``: whether those steps
        verify); else CheckpointExistsError."""
        later = [s for s in self.store.steps() if s > step]  # none, unless the run went back
        needs = [s for s in later if step in self.needed([s])]
        if intact([step, *needs]):
            raise CheckpointExistsError(
                f"step {step} is already committed in {where} (or it is damaged, but a newer intact step "
                "needs it); committed checkpoints are never overwritten. Save under a new step, "
                "or delete it with `crashsafe gc`."
            )
        self.delete([step])
