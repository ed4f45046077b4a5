"""Analysis stage (docs/protocols.md, A1-A5): why a positional scheme extrapolates or breaks.

A1 ``erf``        cumulative normalized gradient and ERF (Sandwich paper §5.1), Qin's attention ERF
A2 ``theory``     convergence of sum exp(bias) and the TRF n_the(eps) (Qin et al. 2024, Thm. 0.4, eq. 22)
A3 ``bias``       bias/exp(bias) heat maps, last row + log fit, kernels, effective length (thesis §3.7.5)
A4 ``nope``       NoPE variance vs Lemma 2.3, trained checkpoint; ``nope_probe`` position probe (thesis ch. 2)
A5 ``sharpness``  mean max attention probability and entropy by length (thesis Table 5.1)
``analyze_all(run_dir)`` runs all of them on a trained run and writes ``<run>/analysis/``.
"""
from .bias import (bias_grid, distance_curve, effective_length_counts, effective_lengths, last_row,
                   plot_bias_heatmap, plot_dbar_sweep, plot_effective_length, plot_kernels, plot_last_row_fit)
from .compare import compare_runs, plot_trf_curves, plot_trf_vs_erf, trf_summary
from .erf import ERF_CONVENTION, attention_erf, cumulative_gradient, erf, measure_erf, plot_erf
from .nope import (model_variance, plot_cumulative_attention, plot_variance, random_tlm, sigma_sweep,
                   simulate_variance)
from .nope_probe import LinearProbe, plot_probe, position_probe, probe_features
from .runner import analyze_all
from .sharpness import attention_sharpness, plot_sharpness, sharpness_from_probs, sharpness_table
from .theory import CLOSED_FORMS, b_values, convergence, numeric_series, trf, trf_curve

__all__ = [
    "ERF_CONVENTION", "attention_erf", "cumulative_gradient", "erf", "measure_erf", "plot_erf",
    "CLOSED_FORMS", "b_values", "convergence", "numeric_series", "trf", "trf_curve",
    "compare_runs", "plot_trf_curves", "plot_trf_vs_erf", "trf_summary",
    "bias_grid", "distance_curve", "effective_length_counts", "effective_lengths", "last_row",
    "plot_bias_heatmap", "plot_dbar_sweep", "plot_effective_length", "plot_kernels", "plot_last_row_fit",
    "model_variance", "plot_cumulative_attention", "plot_probe", "plot_variance", "position_probe",
    "LinearProbe", "probe_features", "random_tlm", "sigma_sweep", "simulate_variance",
    "attention_sharpness", "plot_sharpness", "sharpness_from_probs", "sharpness_table",
    "analyze_all",
]
