"""``bench/grpo.py``'s summary of its rounds: per mode and M the median and spread of every figure,
the ratios of the modes' medians, and (``*_paired``) each round's latencies over the other mode's
in the same round (the rounds alternate modes, so a pair ran under about the same machine load)."""

from __future__ import annotations

import statistics
from typing import Any

#: latencies compared round by round (``*_paired`` in the summary)
PAIRED = ("group_completion_s", "sibling_turn0_s_mean", "sibling_turn0_s_max")


def summarize(rounds: dict[tuple[int, str], list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (m, mode), figures in rounds.items():
        entry = out.setdefault(f"M={m}", {})
        entry[mode] = {
            name: {
                "median": round(statistics.median(f[name] for f in figures), 4),
                "spread": [round(min(f[name] for f in figures), 4), round(max(f[name] for f in figures), 4)],
            }
            for name in figures[0]
        }
    for m_label, entry in out.items():
        m = int(m_label.removeprefix("M="))
        for a, b in (
            ("ahead", "bounded"),
            ("ahead", "groups"),
            ("ahead", "today"),
            ("bounded", "groups"),
            ("groups", "today"),
            ("bounded", "today"),
        ):
            if a in entry and b in entry:
                entry[f"{a}_over_{b}"] = {
                    name: round(entry[a][name]["median"] / entry[b][name]["median"], 4)
                    for name in entry[a]
                    if entry[b][name]["median"]
                }
                entry[f"{a}_over_{b}_paired"] = paired(rounds[(m, a)], rounds[(m, b)])
    return out


def paired(a: list[dict[str, float]], b: list[dict[str, float]]) -> dict[str, Any]:
    """Round by round (the two modes' rounds alternate, so each pair ran under about the same
    load): ``a``'s latency over ``b``'s, median and spread, and in how many pairs ``a`` was slower."""
    out: dict[str, Any] = {}
    for name in PAIRED:
        ratios = [x[name] / y[name] for x, y in zip(a, b, strict=True) if y[name]]
        if ratios:
            out[name] = {
                "median": round(statistics.median(ratios), 4),
                "spread": [round(min(ratios), 4), round(max(ratios), 4)],
                "slower_in": f"{sum(r > 1 for r in ratios)}/{len(ratios)}",
            }
    return out
