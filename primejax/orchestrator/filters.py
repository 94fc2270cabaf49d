"""Rollout filters and their two slots (docs/algorithms.md).

A filter is a predicate over one finalized rollout ("flag this one"). The pre-batch slot runs before the
batch is cut and by default only monitors (flags are counted, nothing is dropped) unless `enforce`; the
post-batch slot runs on the cut batch and enforces: flagged rollouts are recorded but not shipped. Every
rollout keeps the names of the filters that flagged it, so filtered rollouts still show up in metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from primejax.orchestrator.rollout import Rollout
from primejax.utils.sections import Section, option, section

FilterFn = Callable[[Rollout], bool]
FILTERS = ("gibberish", "repetition", "zero_advantage")  # the names `orchestrator.filters` slots accept


@section
class FiltersConfig(Section):
    """Rollout filters: the pre-batch slot monitors (or enforces), the post-batch slot drops what it flags."""

    pre_batch: tuple = option(
        ("gibberish", "repetition", "zero_advantage"), "filters before the batch cut", choices=FILTERS
    )
    pre_batch_enforce: bool = option(False, "drop what the pre-batch filters flag")
    post_batch: tuple = option(
        ("gibberish", "repetition", "zero_advantage"), "filters on the cut batch", choices=FILTERS
    )
    post_batch_enforce: bool = option(True, "drop what the post-batch filters flag")
    gibberish_threshold: float = option(-8.0, "mean sampled logprob below this = gibberish")
    repetition_threshold: float = option(
        0.5, "fraction of repeated n-grams above this = repetitive", ge=0, le=1
    )
    repetition_ngram: int = option(4, "n of the repetition filter's n-grams", gt=0)


def zero_advantage(rollout: Rollout) -> bool:
    """Flags rollouts whose advantage stream is all zero. No stream (opd/opsd/sft) never fires."""
    return rollout.advantages is not None and not any(rollout.advantages)


def make_gibberish(threshold: float) -> FilterFn:
    """Flags rollouts whose mean sampled logprob is below `threshold` (degenerate, high-entropy output)."""

    def gibberish(rollout: Rollout) -> bool:
        logprobs = rollout.completion_logprobs
        return bool(logprobs) and sum(logprobs) / len(logprobs) < threshold

    return gibberish


def repetition_fraction(tokens: list[int], n: int) -> float:
    """Share of the n-grams of `tokens` that repeat an earlier n-gram (0 for fewer than two n-grams)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if len(grams) < 2:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def make_repetition(threshold: float, ngram: int) -> FilterFn:
    """Flags rollouts whose sampled tokens repeat n-grams more than `threshold` of the time (looping).

    Measured per model turn (worst turn counts): across turns, restating earlier content is often the task
    (alphabet-sort re-sorts the names it already listed), not degeneration."""

    def repetition(rollout: Rollout) -> bool:
        return any(repetition_fraction(s.completion_ids, ngram) > threshold for s in rollout.steps)

    return repetition


@dataclass
class FilterSlot:
    name: str  # "pre_batch" | "post_batch"
    filters: dict[str, FilterFn]
    enforce: bool

    def apply(self, rollouts: list[Rollout]) -> tuple[list[Rollout], Counter]:
        """Flag each clean rollout with every filter; return the rollouts that go on and the flag counts."""
        counts: Counter = Counter()
        kept = []
        for rollout in rollouts:
            flagged = [name for name, fn in self.filters.items() if rollout.ok and fn(rollout)]
            for name in flagged:
                counts[name] += 1
                if name not in rollout.filtered_by:
                    rollout.filtered_by.append(name)
            if flagged and self.enforce and not rollout.dropped:
                rollout.dropped = True
                counts["dropped"] += 1
            else:
                kept.append(rollout)
        return kept, counts


def build_filter(name: str, cfg: FiltersConfig) -> FilterFn:
    if name == "zero_advantage":
        return zero_advantage
    if name == "gibberish":
        return make_gibberish(cfg.gibberish_threshold)
    if name == "repetition":
        return make_repetition(cfg.repetition_threshold, cfg.repetition_ngram)
    raise KeyError(f"unknown filter {name!r}")


def build_slots(cfg: FiltersConfig) -> tuple[FilterSlot, FilterSlot]:
    """The pre- and post-batch slots from `orchestrator.filters`."""
    pre = FilterSlot("pre_batch", {n: build_filter(n, cfg) for n in cfg.pre_batch}, cfg.pre_batch_enforce)
    post = FilterSlot("post_batch", {n: build_filter(n, cfg) for n in cfg.post_batch}, cfg.post_batch_enforce)
    return pre, post
