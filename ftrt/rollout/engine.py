"""The built-in rollout engine: the job's policy, one weight version at a time, sampling prompt groups.

A sample is a pure function of (seed, step, prompt_id, sample_idx, weights): every group is
sampled alone (:func:`ftrt.policy.sample.sample_group`, a forward batch of exactly G rows), with
uniforms drawn from counters, so which server made it, what else it was serving and how often it
restarted do not change a bit of it.

:meth:`BuiltinEngine.apply` adds a whole version at once: the pushed tensors go into a fresh copy
of the policy, published in one assignment; a group being sampled keeps the copy it started with.
An engine holds the versions the trainer still asks for (a push says which: with
``max_off_policy_steps=K`` the trainer needs up to K+1 at a time), at most :data:`MAX_HELD`.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass

import torch

from ftrt.policy.sample import sample_group
from ftrt.policy.setting import build_setting
from ftrt.policy.spec import PolicySpec
from ftrt.rollout.weights import Expected, expected_of

NO_VERSION = -1
MAX_HELD = 10


@dataclass(frozen=True)
class Held:
    """The weights a server serves: a version, its digest and the policy built from them."""

    version: int
    digest: str
    model: torch.nn.Module | None


class BuiltinEngine:
    """The GRPO policy of ``spec`` behind a version switch."""

    name = "builtin"
    max_versions = MAX_HELD

    def __init__(self, spec: PolicySpec) -> None:
        torch.set_num_threads(spec.threads)
        self.spec = spec
        built = build_setting(spec.model, spec.task, seed=spec.seed, max_new_tokens=spec.max_new_tokens)
        self.task, self.vocab, self.max_new = built.task, built.vocab, built.max_new
        self._skeleton = built.model.eval().requires_grad_(False)
        self.expected: dict[str, Expected] = expected_of(self._skeleton.state_dict())
        self._held: dict[int, Held] = {}
        self._lock = threading.Lock()

    @property
    def versions(self) -> dict[int, str]:
        """Every version held, with its digest."""
        return {v: h.digest for v, h in sorted(self._held.items())}

    @property
    def newest(self) -> Held:
        held = self._held
        return held[max(held)] if held else Held(NO_VERSION, "", None)

    def lookup(self, version: int, digest: str) -> Held | None:
        """The weights of ``version`` if held with exactly this digest."""
        h = self._held.get(version)
        return h if h is not None and h.digest == digest else None

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def apply(self, version: int, digest: str, tensors: dict[str, torch.Tensor], keep_from: int) -> float:
        """Serve ``tensors`` as ``version`` from now on (all of them or, on an error, none) and drop
        the versions below ``keep_from`` (never ``version`` itself); return the seconds it took."""
        t0 = time.perf_counter()
        model = copy.deepcopy(self._skeleton)
        model.load_state_dict(tensors, strict=True, assign=True)
        model.eval().requires_grad_(False)
        with self._lock:
            held = {v: h for v, h in self._held.items() if v >= keep_from and v != version}
            held[version] = Held(version, digest, model)
            while len(held) > MAX_HELD:
                del held[min(held)]
            self._held = held  # one assignment: readers see the old dict or the new one
        return time.perf_counter() - t0

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def generate(self, held: Held, step: int, prompt_id: int) -> torch.Tensor:
        """Prompt ``prompt_id``'s group at ``step`` with the weights ``held``: (G, max_new) token ids."""
        assert held.model is not None
        with torch.no_grad():
            return sample_group(held.model, self.task, self.vocab, seed=self.spec.seed, step=step,
                                prompt_id=prompt_id, group=self.spec.group_size, max_new=self.max_new,
                                temperature=self.spec.temperature)
