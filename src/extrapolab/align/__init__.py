"""Softmax-temperature attention alignment, the study of thesis ch. 5 (Chi 2024).

:mod:`.rules` the Algorithm 1 grid, the length-only rule and Props. 5.1/5.2; :mod:`.temperature`
softmax temperature per layer and per-softmax statistics; :mod:`.algorithm` Algorithm 1 over a
model and the stored ``temperature.json``; :mod:`.plots` the tau table and curves; retrieval
(passkey / key-value lines) is scored at each rule's tau on the prompts of
:mod:`extrapolab.tasks.retrieval`; :mod:`.hf_t5` the Hugging Face T5 target;
:mod:`.experiment` and :mod:`.tables` the one-command study (`extrapolab align experiment`);
:mod:`.rope_study` and :mod:`.rope_report` RoPE context extension (PI, NTK, dynamic NTK, YaRN) against
temperature alignment on one rotary run (`extrapolab align rope`; the same methods on a pretrained
model are the study of :mod:`extrapolab.extend`); :mod:`.hf_causal` Algorithm 1 and retrieval on
Hugging Face causal LMs (`hf:PATH`), with :mod:`.onepass` running Algorithm 1 in fused forwards;
:mod:`.head_scale` the head scale for NoPE (Wang et al. 2024): a uniform-scale search, then λ per
head tuned alone at the target length.
"""
from .algorithm import TEMPERATURE_FILE, align, collect_logit_stats, load_temperature, save_temperature
from .plots import align_table, plot_temperature_curves
from .rules import GRID, MODES, RULES, canonical_rule, length_rule, pick_tau, prop51_tau, prop52_tau
from .temperature import GPTTarget, SoftmaxStats, as_target, temperature_scope

__all__ = [
    "GRID", "MODES", "RULES", "TEMPERATURE_FILE", "GPTTarget", "SoftmaxStats", "align", "align_table",
    "as_target", "canonical_rule", "collect_logit_stats", "length_rule", "load_temperature",
    "pick_tau", "plot_temperature_curves", "prop51_tau", "prop52_tau", "save_temperature",
    "temperature_scope",
]
