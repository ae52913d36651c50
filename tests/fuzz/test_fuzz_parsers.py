"""Fuzzing the parsers of untrusted bytes (a few hundred inputs per strategy; ``python -m bench fuzz``
runs 100k+). Random bytes, mutated valid inputs and structure-aware inputs go into the manifest codec,
the safetensors header parser, the object codec, and ``ckpt.verify`` on a whole hostile checkpoint.

Each input must end in success or a ``CheckpointError`` subclass, within 2 s, allocating at most what
its size justifies (tests/fuzz/targets.py: 256 bytes per input byte + a fixed allowance). Escapes
that match a reported bug (``targets.KNOWN_ESCAPES``, each with a strict-xfail test in
tests/integrity/test_hostile_input.py) are tallied, not failed.
"""

from __future__ import annotations

import pytest

from tests.fuzz.targets import TARGETS, Seeds, Stats, VerifyTarget, campaign, make_seeds, strategies

EXAMPLES = {"manifest": 200, "header": 250, "object": 250, "verify": 120}


@pytest.fixture(scope="module")
def seeds() -> Seeds:
    return make_seeds()


def _cases() -> list[tuple[str, str]]:
    resealed = "mutated body, resealed"  # format 2: a valid checksum around a mutated body
    names = {"manifest": ["random", "mutated", resealed, "structured"], "header": ["random", "mutated", "structured"],
             "object": ["random", "mutated", "structured"], "verify": ["mutated", resealed, "structured"]}
    return [(t, s) for t, ss in names.items() for s in ss]


@pytest.mark.slow
@pytest.mark.parametrize(("target", "strategy"), _cases(), ids=[f"{t}-{s}" for t, s in _cases()])
def test_only_checkpoint_errors_escape(seeds: Seeds, tmp_path, target: str, strategy: str):
    strat = dict(strategies(seeds, big=False)[target])[strategy]
    fn = VerifyTarget(str(tmp_path)) if target == "verify" else TARGETS[target]
    stats: Stats = campaign(target, fn, strat, EXAMPLES[target], seed=12345)
    d = stats.to_dict()
    assert stats.inputs >= EXAMPLES[target] // 2, d  # hypothesis may stop early on a small search space
    assert stats.escape_count == 0, "\n".join(stats.escapes)
    assert not stats.slow, stats.slow
    assert not stats.big_alloc, stats.big_alloc
    if strategy == "random" and target != "object":
        assert stats.accepted == 0  # random bytes never make a valid manifest or header
    if strategy != "random" and target in ("manifest", "verify"):
        assert stats.accepted > 0  # the strategy reaches past the first checks
