"""Does a sweep's E1 table show the papers' picture? (ALiBi Fig. 1/Table 2, KERPLE Table 2,
Sandwich Table 3: absolute embeddings fail beyond L_tr, ALiBi and windowed attention stay flat,
relative biases keep improving with more context.)

Checked on the mean nonoverlapping perplexity per scheme (label prefix before "(" is the scheme):
* sinusoidal / learned APE fail: ppl at the longest L_ex > (1 + FAIL) x ppl at L_tr, or no value;
* alibi / windowed stay flat: every L_ex > L_tr within ±FLAT of ppl at L_tr;
* t5 / kerple-log / sandwich improve: some L_ex > L_tr has a lower ppl than L_tr.
A scheme missing from the sweep is not checked.
"""
from __future__ import annotations

import math

FAIL, FLAT = 0.10, 0.05
CLAIMS = {"sinusoidal": "fails", "learned": "fails", "alibi": "flat", "windowed": "flat",
          "t5": "improves", "kerple-log": "improves", "sandwich": "improves"}


def picture_checks(means: dict[str, dict[int, float]], train_length: int) -> list[tuple[str, bool, str]]:
    """[(scheme label, claim holds, 'claim: numbers')] for every scheme with a claim."""
    out = []
    for label, by_len in means.items():
        claim = CLAIMS.get(label.split("(")[0])
        base = by_len.get(train_length)
        if claim is None or base is None or not math.isfinite(base):
            continue
        longer = {L: v for L, v in sorted(by_len.items()) if L > train_length and v is not None and math.isfinite(v)}
        if claim == "fails":
            last = max(longer, default=None)
            ok = last is None or longer[last] > (1 + FAIL) * base
            detail = f"fails beyond L_tr: {base:.1f} at {train_length} -> " + (
                f"{longer[last]:.1f} at {last}" if last else "cannot run beyond L_tr")
        elif claim == "flat":
            worst = max((abs(v / base - 1) for v in longer.values()), default=0.0)
            ok, detail = worst <= FLAT, f"stays flat: worst change {worst:.1%} beyond L_tr (limit {FLAT:.0%})"
        else:
            L, v = min(longer.items(), key=lambda kv: kv[1]) if longer else (None, math.inf)
            ok, detail = v < base, f"improves beyond L_tr: {base:.1f} at {train_length} -> best {v:.1f} at {L}"
        out.append((label, ok, detail))
    return out


def picture_markdown(means: dict[str, dict[int, float]], train_length: int) -> str:
    rows = picture_checks(means, train_length)
    if not rows:
        return ""
    lines = ["| scheme | papers' picture (E1 mean ppl) | holds |", "|---|---|---|"]
    lines += [f"| {label} | {detail} | {'yes' if ok else 'NO'} |" for label, ok, detail in rows]
    return "\n".join(lines) + "\n"
