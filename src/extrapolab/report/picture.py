"""Does a sweep show the papers' picture? Each paper's length-extrapolation claim as data (:class:`Claim`),
checked by one function (:func:`check_claims`) on the mean perplexities a sweep stored.

A claim names the scheme it is about and, for a comparison, the scheme it is compared with (both as
the label key: a label's text before "(", so ``t5(max_distance=32)`` is ``t5``; give a variant its own
label, as modern-quick's ``rotary+random`` and ``xpos+bca``), the protocol (E1 ``nonoverlapping``, E3
``last_token``, or A6 ``first_token``: the mean attention weight on token 0 over layers, where a sweep
records it), the lengths (``beyond``: every L_ex > L_tr; ``longest``: the longest L_ex only; ``train``:
L_tr itself, for a claim about the trained length) and the test, on the mean value per L_ex over seeds
(perplexity, or the A6 mass):

* ``fails``: ppl at the longest L_ex > (1 + FAIL) x ppl at L_tr, or no value (cannot run);
* ``flat``: every selected L_ex within ±FLAT of ppl at L_tr;
* ``improves``: some selected L_ex has a lower ppl than L_tr;
* ``below``: lower ppl than the reference at the selected L_ex;
* ``at_or_below``: ppl <= (1 + TIE) x the reference's at the selected L_ex;
* ``flatter``: a smaller rise ppl(L)/ppl(L_tr) - 1 than the reference's at the selected L_ex.

A comparison holds ("yes") at every selected length, "partly" at some, "NO" at none. A scheme missing
from the sweep is not checked; a missing reference is said so. The papers' settings are far larger
than a CPU sweep (:attr:`Claim.setting`): the report lists them under the table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

FAIL, FLAT, TIE = 0.10, 0.05, 0.02
TESTS = ("fails", "flat", "improves", "below", "at_or_below", "flatter")
E1, E3, A6 = "nonoverlapping", "last_token", "first_token"


@dataclass(frozen=True)
class Claim:
    scheme: str  # label key of the scheme the claim is about
    test: str  # one of TESTS
    claim: str  # the paper's claim in words
    cite: str  # paper, section / figure / table
    reference: str = ""  # label key of the scheme compared with ("" = the scheme itself at L_tr)
    protocol: str = E1
    lengths: str = "beyond"  # beyond | longest | train
    setting: str = ""  # where the paper measured it


ALIBI = "Press et al. 2022 (ALiBi)"
#: the post-2023 papers are cited by their abstracts (the claim's direction is stated there; settings
#: only where the abstract gives them): their full texts were not read where these rows were written
COPE, COPE_SETTING = ("Golovneva et al. 2024 (CoPE), arXiv 2405.18719, abstract: better perplexity on "
                      "language and code modeling", "")
DAPE, DAPE_SETTING = ("Zheng et al. 2024 (DAPE), arXiv 2405.14722, abstract",
                      "Arxiv, Books3, CHE; trained at 128, better than static encodings at 8192")
GEMMA3 = "Gemma Team 2025, Gemma 3 Technical Report, arXiv 2503.19786"
GATE, GATE_SETTING = ("Qiu et al. 2025 (Gated Attention), arXiv 2505.06708, abstract",
                      "1.7B dense and 15B MoE models, 3.5T tokens")
RNOPE, RNOPE_SETTING = ("Yang et al. 2025 (Rope to Nope and Back Again), arXiv 2501.18795",
                        "8B-size models, long-context tasks (NIAH, RULER), not perplexity")
SMOL, SMOL_SETTING = ("Hugging Face 2025, SmolLM3 blog (NoPE every 4th layer: 'improves long context performance "
                      "without affecting short context')", "3B model, ablations at 1B-3B; long context after extension")
#: the papers' claims; a scheme added to the zoo adds its claims here, one entry each
CLAIMS: tuple[Claim, ...] = (
    Claim("sinusoidal", "fails", "fails beyond L_tr", f"{ALIBI} §2, Fig. 1", setting="WikiText-103, L_tr 512/1024"),
    Claim("learned", "fails", "cannot run beyond L_tr", f"{ALIBI} §2.2"),
    Claim("alibi", "flat", "stays flat beyond L_tr", f"{ALIBI} §4, Fig. 1", setting="WikiText-103, L_tr 512/1024"),
    Claim("windowed", "flat", "stays flat beyond L_tr", "Chi et al. 2023 (Sandwich) §3.3"),
    Claim("t5", "improves", "improves with more context", "Chi et al. 2022 (KERPLE) Table 2"),
    Claim("kerple-log", "improves", "improves with more context", "Chi et al. 2022 (KERPLE) Table 2",
          setting="OpenWebText2/GitHub/ArXiv, 162M params, L_tr 512, eval to 16k"),
    Claim("sandwich", "improves", "improves with more context", "Chi et al. 2023 (Sandwich) Table 3"),
    Claim("fire", "at_or_below", "at or below KERPLE beyond L_tr (it can represent T5's RPE, ALiBi and KERPLE "
          "and generalizes better to longer contexts)", "Li et al. 2024 (FIRE), arXiv 2310.04418, abstract",
          "kerple-log", setting="zero-shot language modeling and long-text benchmarks"),
    Claim("fox", "flatter", "rises less than RoPE beyond L_tr (outperforms the Transformer on length "
          "extrapolation)", "Lin et al. 2025 (Forgetting Transformer), arXiv 2503.02130, abstract", "rotary"),
    Claim("xpos", "flatter", "more stable than RoPE beyond L_tr (RoPE does not extrapolate; the paper pairs "
          "xPos with BCA, next row)", "Sun et al. 2023 (xPos), arXiv 2212.10554, abstract and its §1 table",
          "rotary", setting="language modeling"),
    Claim("xpos+bca", "flatter", "xPos with blockwise causal attention more stable than RoPE beyond L_tr",
          "Sun et al. 2023 (xPos), arXiv 2212.10554, abstract", "rotary", setting="language modeling"),
    Claim("rotary+random", "below", "randomized positions beat plain RoPE beyond L_tr",
          "Ruoss et al. 2023, arXiv 2305.16843, abstract: +12.0% test accuracy on average", "rotary",
          setting="15 algorithmic reasoning tasks (no language modeling)"),
    Claim("hybrid", "below", "NoPE every k-th layer beats RoPE beyond L_tr",
          "Yang et al. 2025, arXiv 2501.18795, abstract", "rotary", setting="long-context tasks (not perplexity)"),
    Claim("cope", "below", "beats RoPE beyond L_tr", COPE, "rotary", setting=COPE_SETTING),
    Claim("cope", "below", "beats NoPE beyond L_tr", COPE, "none", setting=COPE_SETTING),
    Claim("nope-headscale", "below", "head-scale NoPE beats NoPE beyond L_tr (scales tuned at the target length)",
          "Wang et al. 2024, arXiv 2404.12224, abstract", "none",
          setting="long-sequence language modeling, passkey retrieval, long-context tasks"),
    Claim("stick-breaking", "below", "stick-breaking beats softmax + RoPE beyond L_tr",
          "Tan et al. 2025 (stick-breaking), arXiv 2410.17980, abstract", "rotary",
          setting="trained at 2^11 tokens, perplexity improvements at 2^14"),
    Claim("dape-alibi", "below", "DAPE beats its base beyond L_tr", DAPE, "alibi", setting=DAPE_SETTING),
    Claim("dape-kerple", "below", "DAPE beats its base beyond L_tr", DAPE, "kerple-log", setting=DAPE_SETTING),
    Claim("dape-fire", "below", "DAPE beats its base beyond L_tr", DAPE, "fire", setting=DAPE_SETTING),
    # layer types (positional/layouts.py) and the RoPE kinds read over a RoPE run (layouts-quick)
    Claim("gemma3", "at_or_below", "5 sliding layers per global one cost (almost) no perplexity at the trained length",
          f"{GEMMA3}, §5 ablations (local:global ratio, sliding window size)", "rotary", lengths="train",
          setting="the report's ablation models, window 1,024"),
    Claim("rnope-swa", "at_or_below", "RoPE with a sliding window and NoPE global layers at or below RoPE beyond L_tr",
          f"{RNOPE}, abstract and §5", "rotary", setting=RNOPE_SETTING),
    Claim("irope", "flatter", "NoPE global layers with a position temperature generalize beyond L_tr better than RoPE",
          "Meta 2025, The Llama 4 herd (iRoPE: 'to enhance length generalization')", "rotary",
          setting="Llama 4 Scout, 256k pre-training context"),
    Claim("smollm3", "at_or_below", "NoPE every 4th layer leaves short-context perplexity unchanged", SMOL, "rotary",
          lengths="train", setting=SMOL_SETTING),
    Claim("smollm3", "below", "NoPE every 4th layer improves long-context modelling", SMOL, "rotary",
          setting=SMOL_SETTING),
    Claim("rotary-proportional", "at_or_below", "p-RoPE (the lowest frequencies removed) at or below RoPE",
          "Barbero et al. 2025 (Round and Round We Go!), arXiv 2410.06205, abstract and Table 2", "rotary",
          lengths="train", setting="Gemma models trained with p-RoPE, not a length-extrapolation claim"),
    Claim("rotary-yarn", "below", "YaRN over a RoPE model beats plain RoPE beyond L_tr without fine-tuning",
          "Peng et al. 2023 (YaRN), arXiv 2309.00071, §3 (dynamic scaling without fine-tuning)", "rotary",
          setting="Llama 2 7B/13B; the paper's training-free result is dynamic scaling, here static s = 16"),
    Claim("rotary-llama3", "below", "Llama 3.1's scaling extends RoPE beyond L_tr", "Meta 2024, The Llama 3 Herd of "
          "Models, arXiv 2407.21783 (llama3 rope scaling)", "rotary",
          setting="with continued pre-training from 8k to 128k; here training-free"),
    Claim("rotary-longrope", "below", "LongRoPE's rescaling extends RoPE beyond L_tr without fine-tuning (8x)",
          "Ding et al. 2024 (LongRoPE), arXiv 2402.13753, abstract", "rotary",
          setting="searched non-uniform factors; here uniform long factors = s, so PI with LongRoPE's attention factor"),
    # the attention options and schemes of issue 33 §2 (layouts-quick): A6 is the attention on token 0
    Claim("rotary+sinks", "below", "a learned sink logit per head takes the attention the first token absorbs",
          "OpenAI 2025, gpt-oss model card (learned sink per head); Xiao et al. 2024 (StreamingLLM), arXiv 2309.17453, "
          "§3.3 (a dedicated learnable sink)", "rotary", protocol=A6, setting="gpt-oss 20B/120B; StreamingLLM 160M "
          "models pre-trained with a sink token"),
    Claim("rotary+ssmax", "flatter", "SSMax keeps attention from flattening beyond the training length",
          "Nakanishi 2025 (Scalable-Softmax), arXiv 2501.19399, abstract", "rotary",
          setting="the paper's pre-trained models (scale not read here: the claim is from the abstract)"),
    Claim("rotary+gate", "below", "the output gate mitigates the attention sink", GATE, "rotary", protocol=A6,
          setting=GATE_SETTING),
    Claim("rotary+gate", "flatter", "the output gate enhances long-context extrapolation", GATE, "rotary",
          setting=GATE_SETTING),
    Claim("pope", "flatter", "PoPE extrapolates zero-shot where RoPE degrades",
          "Gopalakrishnan et al. 2025 (PoPE), arXiv 2509.10534, abstract", "rotary",
          setting="the paper's sequence models (scale not read here: the claim is from the abstract)"),
    Claim("selective", "at_or_below", "selective attention improves language-modelling perplexity",
          "Leviathan et al. 2025 (Selective Attention), arXiv 2410.02703, abstract", "rotary", lengths="train",
          setting="C4 language modelling (sizes not read here: the claim is from the abstract)"),
)


def key(label: str) -> str:
    return label.split("(")[0].strip()


@dataclass
class Check:
    label: str
    claim: Claim
    verdict: str  # yes | partly | NO | — (reference missing)
    detail: str

    @property
    def ok(self) -> bool:
        return self.verdict == "yes"


def _finite(by_len: dict) -> dict:
    return {int(L): float(v) for L, v in by_len.items() if v is not None and math.isfinite(float(v))}


def _own(c: Claim, mine: dict, base: float, Ltr: int, longer: dict) -> tuple[bool, str]:
    if c.test == "fails":
        last = max(mine, default=Ltr)
        ok = last <= Ltr or mine[last] > (1 + FAIL) * base
        return ok, f"{base:.1f} at {Ltr} -> " + (f"{mine[last]:.1f} at {last}" if last > Ltr else "cannot run beyond L_tr")
    if c.test == "flat":
        worst = max((abs(v / base - 1) for v in longer.values()), default=0.0)
        return worst <= FLAT, f"worst change {worst:.1%} beyond L_tr (limit {FLAT:.0%})"
    L, v = min(longer.items(), key=lambda kv: kv[1]) if longer else (None, math.inf)
    return v < base, f"{base:.1f} at {Ltr} -> best {v:.1f} at {L}"


def _compare(c: Claim, mine: dict, ref: dict, Ltr: int, lengths: list[int]) -> tuple[int, str]:
    """(lengths where the claim holds, detail) of a comparison with the reference."""
    rise = lambda d, L: d[L] / d[Ltr] - 1  # noqa: E731
    holds, parts = 0, []
    for L in lengths:
        if c.test == "flatter":
            a, b = rise(mine, L), rise(ref, L)
            holds += a < b
            parts.append(f"{L}: {a:+.1%} vs {b:+.1%}")
        else:
            limit = ref[L] * (1 + TIE) if c.test == "at_or_below" else ref[L]
            holds += mine[L] <= limit if c.test == "at_or_below" else mine[L] < limit
            parts.append(f"{L}: {mine[L]:.3f} vs {ref[L]:.3f}" if c.protocol == A6 else f"{L}: {mine[L]:.1f} vs {ref[L]:.1f}")
    what = "rise over ppl at L_tr" if c.test == "flatter" else "mass on token 0" if c.protocol == A6 else "ppl"
    return holds, f"{what} vs {c.reference}: " + ", ".join(parts)


def check_claims(means: dict[str, dict[str, dict[int, float]]], train_length: int,
                 claims=CLAIMS) -> list[Check]:
    """``means`` {protocol: {label: {L_ex: mean ppl}}} -> one Check per (label, claim about its key), in
    label order (the order of the first protocol's labels), each label's claims in ``claims`` order."""
    Ltr, out = int(train_length), []
    labels = list(dict.fromkeys(lb for per in means.values() for lb in per))
    for label in labels:
        for c in (c for c in claims if c.scheme == key(label)):
            mine = _finite(means.get(c.protocol, {}).get(label, {}))
            base = mine.get(Ltr)
            if base is None:
                continue
            longer = {L: v for L, v in mine.items() if L > Ltr}
            if not c.reference:
                ok, detail = _own(c, mine, base, Ltr, longer)
                out.append(Check(label, c, "yes" if ok else "NO", detail))
                continue
            refs = [lb for lb in means.get(c.protocol, {}) if key(lb) == c.reference]
            ref = _finite(means[c.protocol][refs[0]]) if refs else {}
            lengths = sorted(L for L in longer if L in ref)
            if c.lengths == "longest":
                lengths = lengths[-1:]
            if c.lengths == "train":
                lengths = [Ltr] if Ltr in ref else []
            if Ltr not in ref or not lengths:
                where = "at L_tr" if c.lengths == "train" else "beyond L_tr"
                out.append(Check(label, c, "—", f"not checked: no {c.reference} values {where} in this run"))
                continue
            holds, detail = _compare(c, mine, ref, Ltr, lengths)
            verdict = "yes" if holds == len(lengths) else "partly" if holds else "NO"
            out.append(Check(label, c, verdict, detail + f" ({holds}/{len(lengths)} lengths)"))
    return out


def picture_checks(means: dict[str, dict[int, float]], train_length: int) -> list[tuple[str, bool, str]]:
    """[(label, claim holds, detail)] of the E1 claims on one E1 table's means {label: {L: ppl}}."""
    return [(c.label, c.ok, c.detail) for c in check_claims({E1: means}, train_length)]


PROTOCOL_NAMES = {E1: "E1", E3: "E3", A6: "A6"}


def claims_markdown(means: dict[str, dict[str, dict[int, float]]], train_length: int, seeds: int = 1,
                    setting: str = "") -> str:
    """The report's table "scheme | paper's claim (citation) | this run | shown?", the papers' settings
    and how this run differs, or "" when no swept scheme has a claim."""
    rows = check_claims(means, train_length)
    if not rows:
        return ""
    lines = ["| scheme | paper's claim (citation) | this run (mean ppl) | shown? |", "|---|---|---|---|"]
    for r in rows:
        proto = PROTOCOL_NAMES.get(r.claim.protocol, r.claim.protocol)
        lines.append(f"| {r.label} | {r.claim.claim} ({r.claim.cite}) | {proto}: {r.detail} | {r.verdict} |")
    lines += ["", f"Means over {seeds} seed{'s' if seeds != 1 else ''} per length."
              + (" One seed: no significance test was run, and differences of a few percent are within the "
                 "run-to-run spread of this size." if seeds == 1 else ""),
              f"Thresholds: fails = more than {FAIL:.0%} above ppl at L_tr; flat = within ±{FLAT:.0%}; "
              f"at or below = at most {TIE:.0%} above the reference; yes / partly / NO = at every / some / no "
              "compared length."]
    settings = dict.fromkeys(f"{r.claim.cite.split(' §')[0].split(' Table')[0].split(', arXiv')[0]}: {r.claim.setting}"
                             for r in rows if r.claim.setting)
    if settings:
        lines += ["", "Where the papers measured it (this CPU run: " + (setting or "see the budget above")
                  + "); a claim not shown here may still hold at their scale:", ""]
        lines += [f"- {s}" for s in settings]
    return "\n".join(lines) + "\n"
